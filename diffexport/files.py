"""Reading and writing user files safely: one-line errors for bad ONNX files, no half-written outputs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from diffexport.errors import DiffExportError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same folder, then rename: no half-written output.
    The result gets the permissions a plain open() would give (mkstemp's are owner-only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_onnx(path: str | os.PathLike, *, weights: bool = True):
    """An ONNX ModelProto from `path` (without external weights when weights=False); a missing,
    corrupt or truncated file gives one line naming it."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise DiffExportError(f"{path} does not exist or is not a file")
    try:
        return onnx.load(str(path), load_external_data=weights)
    except Exception as exc:  # protobuf DecodeError, missing external data and friends
        raise DiffExportError(f"{path} is not a readable ONNX file ({type(exc).__name__})") from None
