"""Reading and writing user files safely: one-line errors for bad ONNX files, no half-written outputs."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from pathlib import Path

from diffexport.core.errors import DiffExportError
from diffexport.core.stoppable import interrupts_held

# Text inputs (--text, --calib, --prompts-file) are read whole and tokenised at once; the tools use
# at most a few million tokens of them, so a bigger file is refused before it is read.
MAX_TEXT_BYTES = 64 * 2**20


def read_text_input(path: str | os.PathLike, kind: str, expected: str, remedy: str) -> str:
    """The whole of a user's text file, or one line: `kind` not found, not a regular file (give
    `expected`), over MAX_TEXT_BYTES (`remedy`), not UTF-8."""
    file = Path(path)
    if not file.is_file():
        raise DiffExportError(f"{kind} not found: {path}" if not file.exists() else
                              f"{path} is not a regular file: give {expected}")
    size = file.stat().st_size
    if size > MAX_TEXT_BYTES:
        raise DiffExportError(f"{path} is {size / 2**20:.0f} MiB; a {kind} is read whole and limited to "
                              f"{MAX_TEXT_BYTES >> 20} MiB: {remedy}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DiffExportError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


NAME_MAX = 255  # bytes in one file name on Linux, macOS and Windows file systems alike


def temp_prefix(name: str) -> str:
    """A hidden prefix for the temporary twin of `name` that leaves room for mkstemp's random part
    and suffix: a legal 250-byte output name must not fail because its temporary name is longer."""
    while len(os.fsencode(name)) > 200:
        name = name[:-1]
    return f".{name}."


def refuse_output_over_inputs(output: Path, inputs) -> None:
    """An output that is, contains or lies inside one of the command's inputs (files or folders that
    exist; other names, such as hub ids, are skipped) is refused in one line, whatever --force says:
    replacing it would destroy the input, or the user's files beside it."""
    out = Path(os.path.realpath(output))  # the parents' links followed, as the write would
    for source in inputs:
        if source is None or not os.path.lexists(source):
            continue
        src = Path(os.path.realpath(source))
        if out == src or out in src.parents or src in out.parents:
            how = "is" if out == src else "contains" if out in src.parents else "lies inside"
            raise DiffExportError(f"output {output} {how} the input {source}: write it elsewhere (an input is never "
                                  "replaced, with or without --force)")


def check_output_path(path: Path, suffixes: tuple[str, ...] = ("",), replace: bool | None = None,
                      inputs=()) -> None:
    """Validate, before any work, an output path: its folder (check_output_folder), a name that
    ONNX and TensorRT can take (UTF-8), and every file name it will be written as (path + each
    suffix, e.g. ".data") within the file-name limit. replace: the one rule for outputs that are
    already there (files, folders, engines, their sidecars): refused unless replace is True
    (--force); a symbolic link is never written through or replaced. None leaves the rule to the
    caller (check's scratch folder, which holds only its own files). inputs: the command's inputs,
    which the output may not be, contain or lie inside (refuse_output_over_inputs)."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise DiffExportError(f"output {str(path) or '.'!r} names no file or folder of its own: give a new name")
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise DiffExportError(f"output path {os.fsdecode(os.fsencode(path))!r} is not valid UTF-8; "
                              f"ONNX and TensorRT take UTF-8 file names: rename it") from None
    for suffix in suffixes:
        if len(os.fsencode(path.name + suffix)) > NAME_MAX:
            raise DiffExportError(f"output name {path.name[:40]}...{suffix} is longer than {NAME_MAX} bytes: "
                                  f"choose a shorter name")
    check_output_folder(path.parent)
    refuse_output_over_inputs(path, inputs)
    if replace is not None:
        for suffix in suffixes:
            target = path.with_name(path.name + suffix)
            if target.is_symlink():
                raise DiffExportError(f"{target} is a symbolic link: give another output name (links are never "
                                      "written through or replaced)")
            if target.exists() and not replace:
                raise DiffExportError(f"{target} already exists: give a new name, or --force to replace it "
                                      "(nothing is overwritten)")


def atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same folder, then rename: no half-written output.
    The result keeps the mode of the file it replaces, or gets the permissions a plain open()
    would give (mkstemp's are owner-only)."""
    make_output_folder(path.parent)
    tmp = None
    try:
        with interrupts_held():  # the file made and its name bound, or neither
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path.name), suffix=".tmp")
            os.close(fd)
        write(tmp)
        # a file rewritten keeps its mode (a 0600 card stays 0600); a new one gets what open() would give
        mode = path.stat().st_mode & 0o7777 if path.is_file() and not path.is_symlink() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def rename_into_place(tmp_dir: Path, dst: Path, replace: bool = False) -> None:
    """A folder built beside its destination takes its name. Without replace, the rename fails,
    leaving nothing, if dst appeared meanwhile; with it (--force) an existing folder is moved
    aside first and removed once the new one is in place (put back if that rename fails)."""
    if not (replace and dst.is_dir() and not dst.is_symlink()):
        os.rename(tmp_dir, dst)
        return
    swapped, aside = False, None
    try:
        with interrupts_held():  # the swap is done or undone whole, never left half-way
            aside = Path(tempfile.mkdtemp(dir=dst.parent, prefix=temp_prefix(dst.name), suffix=".old"))
            old = aside / dst.name
            os.rename(dst, old)
            try:
                os.rename(tmp_dir, dst)
            except BaseException:
                os.rename(old, dst)
                raise
            swapped = True
    finally:  # an interrupt held back is raised as the block ends: the old folder still goes
        if swapped:
            shutil.rmtree(aside, ignore_errors=True)
        elif aside is not None:
            with contextlib.suppress(OSError):
                aside.rmdir()  # only when empty: the user's folder is never removed here


@contextlib.contextmanager
def staging_folder(dst: Path, replace: bool = False):
    """A folder beside dst to build a folder output in, yielded empty. When the block ends, it takes
    dst's name (its folders with the permissions the umask gives; without replace the rename fails,
    leaving nothing, if dst appeared meanwhile); when the block raises or is interrupted, it is
    removed. The one way every folder output is published: nothing half-written stays, nothing
    existing is replaced without replace."""
    dst = Path(dst)
    make_output_folder(dst.parent)
    tmp = None
    try:
        with interrupts_held():  # the folder made and its name bound, or neither
            tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=temp_prefix(dst.name), suffix=".tmp"))
        yield tmp
        for path in [tmp, *tmp.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                os.chmod(path, 0o777 & ~_umask())
        rename_into_place(tmp, dst, replace)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def staging_model_file(out_path: Path):
    """A scratch folder beside out_path, yielded, to write a model file into under out_path's name
    (with its .data twin when its weights are external, and any scratch files). When the block ends,
    the model takes out_path's place, its data file first, so a model file never points at nothing;
    the scratch folder is removed however the block ends."""
    out_path = Path(out_path)
    make_output_folder(out_path.parent)
    tmp = None
    try:
        with interrupts_held():  # the folder made and its name bound, or neither
            tmp = Path(tempfile.mkdtemp(dir=out_path.parent, prefix=temp_prefix(out_path.name), suffix=".tmp"))
        yield tmp
        data = tmp / (out_path.name + ".data")
        if data.exists():
            os.replace(data, out_path.with_name(data.name))
        os.replace(tmp / out_path.name, out_path)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def check_output_folder(folder: Path) -> None:
    """Validate, before any work, the folder an output will go into: it exists as a writable
    folder, or its nearest existing ancestor is one (the missing folders are made at write time,
    as optimum-cli does); anything else is one line."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise DiffExportError(f"output folder {folder}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise DiffExportError(f"output folder {folder}: {probe} is not writable")
    try:  # os.access says yes to root everywhere; an unnamed file asks the file system itself
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as exc:
        raise DiffExportError(f"output folder {folder}: {probe} is not writable ({exc.strerror})") from None


def make_output_folder(folder: Path) -> None:
    """The output's folder, made (with missing parents) once the work is ready to be written."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DiffExportError(f"cannot create output folder {folder}: {exc.strerror}") from None


def is_hub_cache_link(path: Path) -> bool:
    """Whether `path` is a link that huggingface_hub's cache writes: a file of
    models--ORG--NAME/snapshots/REV/ that resolves (through every link) to a regular file inside that
    same repository's blobs/ folder. Any other link is the user's (or an attacker's) and is refused
    where a folder's files are read."""
    path = Path(path)
    snapshot = path.parent
    repo = snapshot.parent.parent
    if not (path.is_symlink() and snapshot.parent.name == "snapshots" and repo.name.startswith("models--")):
        return False
    blobs = os.path.realpath(repo / "blobs")
    target = os.path.realpath(path)
    return os.path.commonpath([blobs, target]) == blobs and target != blobs and os.path.isfile(target)


def require_file(path: Path, hint: str) -> None:
    """A one-line refusal unless `path` is a regular file (after links): a missing path and a
    folder, device or FIFO are told apart, and `hint` says what to give instead."""
    if path.is_file():
        return
    if not path.exists():
        raise DiffExportError(f"{path} does not exist: {hint}")
    kind = "a folder" if path.is_dir() else "not a regular file (a device, FIFO or socket)"
    raise DiffExportError(f"{path} is {kind}: {hint}")


def load_onnx(path: str | os.PathLike, *, weights: bool = True):
    """An ONNX ModelProto from `path` (without external weights when weights=False); a missing,
    corrupt or truncated file gives one line naming it."""
    import onnx

    path = Path(path)
    require_file(path, "give an .onnx file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf DecodeError and friends
        raise DiffExportError(f"{path} is not a readable ONNX file ({type(exc).__name__})") from None
    check_declared_sizes(model, path)
    if weights:
        try:
            from onnx.external_data_helper import load_external_data_for_model

            load_external_data_for_model(model, str(path.parent))
        except Exception as exc:  # missing or refused external data
            _refuse_external_data(path, onnx)
            raise DiffExportError(f"{path} is not a readable ONNX file ({type(exc).__name__})") from None
    return model


# bits per element of each ONNX tensor type an initializer may hold (strings: no fixed size)
_ELEMENT_BITS = {"FLOAT": 32, "UINT8": 8, "INT8": 8, "UINT16": 16, "INT16": 16, "INT32": 32, "INT64": 64, "BOOL": 8,
                 "FLOAT16": 16, "DOUBLE": 64, "UINT32": 32, "UINT64": 64, "COMPLEX64": 64, "COMPLEX128": 128,
                 "BFLOAT16": 16, "FLOAT8E4M3FN": 8, "FLOAT8E4M3FNUZ": 8, "FLOAT8E5M2": 8, "FLOAT8E5M2FNUZ": 8,
                 "UINT4": 4, "INT4": 4, "FLOAT4E2M1": 4, "FLOAT8E8M0": 8}


def check_declared_sizes(model, path: Path) -> None:
    """Every initializer's shape must match the bytes it holds, inline or in its external file,
    before anything reads or allocates from the shape: a weight declaring [2**31, 2**31] over 64
    bytes reached onnxruntime's quantizer as a failed reshape."""
    from onnx import TensorProto

    for init in model.graph.initializer:
        type_name = TensorProto.DataType.Name(init.data_type) if init.data_type in TensorProto.DataType.values() \
            else None
        bits = _ELEMENT_BITS.get(type_name)
        if any(d < 0 for d in init.dims):
            raise DiffExportError(f"{path}: weight {init.name!r} declares a negative dimension {list(init.dims)}")
        if bits is None:
            continue  # strings, or a type onnx itself will refuse
        need = (math.prod(init.dims) * bits + 7) // 8
        if init.data_location == TensorProto.EXTERNAL:
            fields = {e.key: e.value for e in init.external_data}
            have = _external_bytes(path.parent, fields)
        elif init.HasField("raw_data"):
            have = len(init.raw_data)
        else:
            continue  # typed fields (float_data, ...): onnx checks their count against the shape itself
        if have is not None and have < need:
            raise DiffExportError(f"{path}: weight {init.name!r} declares shape {list(init.dims)} "
                                  f"({need:,} bytes) but holds {have:,}: the file is truncated or edited")


def _external_bytes(folder: Path, fields: dict) -> int | None:
    """The bytes an external-data entry can supply (its length, within the file); None where the
    file is not there to measure (load reports that)."""
    if external_file_state(folder, fields.get("location", "")) != "present":
        return None
    try:
        offset, size = int(fields.get("offset", 0)), (folder / fields["location"]).stat().st_size
    except (ValueError, OSError):
        return None
    available = max(size - offset, 0)
    length = fields.get("length")
    return min(int(length), available) if length is not None and str(length).isdigit() else available


def external_file_state(folder: Path, location: str) -> str:
    """'present', 'MISSING', or 'REFUSED' for a location outside the model's folder (absolute,
    '..', or a link leading out): such a path is never looked at, so nothing is revealed about
    files elsewhere on the machine (onnx and onnxruntime refuse to load them too)."""
    relative = Path(location)
    if not location or relative.is_absolute() or ".." in relative.parts:
        return "REFUSED"
    probe = folder
    for part in relative.parts:  # no link on the way may lead out of the folder
        probe = probe / part
        if probe.is_symlink():
            return "REFUSED"
    return "present" if probe.is_file() else "MISSING"


def _refuse_external_data(path: Path, onnx) -> None:
    """When loading the weights failed, say which external-data file is at fault (if one is)."""
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception:
        return  # the graph itself is unreadable: the caller's message stands
    for init in graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in init.external_data if e.key == "location"), "")
        state = external_file_state(path.parent, location)
        if state == "REFUSED":
            raise DiffExportError(f"{path}: weight {init.name!r} names external data {location!r} outside the "
                                  "model's folder (absolute, '..' or a link): refused; keep the data file beside "
                                  "the model")
        if state == "MISSING":
            raise DiffExportError(f"{path}: weight {init.name!r} names external data {location!r}, which is not "
                                  "beside the model: copy it there with the .onnx file")
