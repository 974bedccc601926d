"""Hugging Face Hub ids as model sources: an argument that is not an existing path and reads
`org/name` or `org/name@revision` is fetched with huggingface_hub into its cache (progress bars are
the library's), and the local snapshot folder takes its place. Only the files diffexport reads
are fetched: configuration, safetensors weights and their index, tokenizer and generation files.
Never pickled `.bin` weights (loading them can run code) and never Python files (`auto_map` code
is not run either: docs/SECURITY.md). HF_HUB_OFFLINE and the local cache are the library's own:
offline, a cached snapshot is used and a missing one is one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from diffexport.core.errors import DiffExportError

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]{1,255}))?$")
# What a DiffLlama (or Llama) folder holds that diffexport reads.
FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
         "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
         "merges.txt", "chat_template.jinja", "chat_template.json"]
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".onnx", ".safetensors", ".json", ".engine")  # paths, never hub ids


def is_hub_id(source: str | os.PathLike) -> bool:
    """A string that names no existing path and reads as org/name[@revision] (not a file name)."""
    if not isinstance(source, str) or os.path.lexists(source) or source.endswith(FILE_SUFFIXES):
        return False
    return HUB_ID.match(source) is not None


def hub_repo(source: str | os.PathLike) -> str | None:
    """`org/name` of a hub id (the revision left off), None for a path."""
    return HUB_ID.match(source).group("repo") if is_hub_id(source) else None


def _offline_reason() -> str:
    """Why huggingface_hub found no cached snapshot and fetched none: offline by the user's own
    setting, or the Hub not reachable from here."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "while offline (HF_HUB_OFFLINE is set)"
    return "and the Hub could not be reached from here (no network?)"


def resolve(source: str | os.PathLike, what: str = "checkpoint") -> Path:
    """The local folder for `source`: the path itself, or a hub id's snapshot (fetched when needed)."""
    if not is_hub_id(source):
        return Path(source)
    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError:
        raise DiffExportError(f"{source} is not a path here, and reading it as a Hugging Face Hub id needs "
                              "huggingface_hub: pip install 'diffexport[hf]'") from None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    match = HUB_ID.match(str(source))
    repo, revision = match.group("repo"), match.group("revision")
    named = f"{repo}{'@' + revision if revision else ''}"
    try:
        validate_repo_id(repo)  # the library's own rule for a repository name
    except HFValidationError as exc:
        raise DiffExportError(f"{source} is neither a path here nor a valid Hugging Face Hub id: "
                              f"{str(exc).strip().splitlines()[0][:160]}") from None
    if revision is not None and (revision.startswith("/") or ".." in revision.split("/")):
        raise DiffExportError(f"{named}: a revision is a branch, tag or commit, not a path ('..' or a leading '/' "
                              "would lead out of the cache)")
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=FILES))
    except errors.GatedRepoError:
        raise DiffExportError(f"{named} is a gated repository: accept its terms on the Hub and log in "
                              "(`hf auth login`), or download it yourself and give the folder") from None
    except errors.RepositoryNotFoundError:
        raise DiffExportError(f"{source} is neither a path here nor a Hub repository you can read "
                              "(private ones need `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise DiffExportError(f"{repo} has no revision {revision!r}") from None
    except errors.LocalEntryNotFoundError:
        raise DiffExportError(f"{source} is not a path here, and {named} is not in the local Hugging Face cache "
                              f"{_offline_reason()}: download it on a connected machine and carry the cache "
                              "(docs/EXPORT.md), or give its folder") from None
    except (errors.HfHubHTTPError, OSError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DiffExportError(f"cannot fetch {named} from the Hugging Face Hub: {detail}") from None
    snapshots = os.path.realpath(os.path.join(os.path.dirname(os.path.dirname(folder)), "snapshots"))
    real = os.path.realpath(folder)
    if os.path.basename(snapshots) != "snapshots" or os.path.dirname(real) != snapshots:
        # a refs/ file or revision that points elsewhere: the cache's own layout is the only one read
        raise DiffExportError(f"{named} resolved to {real}, outside its repository's snapshots in the Hugging Face "
                              "cache: refused")
    if not (folder / "config.json").is_file():
        raise DiffExportError(f"{named} has no config.json: not a Hugging Face model repository diffexport reads")
    if what == "checkpoint" and not any(folder.glob("*.safetensors")):
        raise DiffExportError(f"{named} has no safetensors weights; diffexport does not fetch pickled .bin weights "
                              "(loading them can run code): use a repository with safetensors, or convert them")
    return folder
