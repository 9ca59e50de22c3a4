"""Checkpoints: everything needed to continue, written atomically, read without running code."""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from utils import UserError

REQUIRED_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "best_acc", "args", "class_names")


def save_atomic(obj: Any, path: Path) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it: a crash or a kill
    at any moment leaves either the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private to the owner; a checkpoint is not secret
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def copy_atomic(src: Path, dst: Path) -> None:
    """`dst` becomes a copy of `src`: a hard link where the file system allows (no bytes
    written), else a real copy, either way swapped in by rename."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    _fsync_dir(dst.parent)


def _fsync_dir(path: Path) -> None:
    # The rename itself is durable only once the directory entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def why_unloadable(error: Exception) -> str:
    """A short reason why torch.load(weights_only=True) failed, without torch's advice to
    retry with weights_only=False, which would run whatever code the file carries."""
    if isinstance(error, pickle.UnpicklingError):
        return "refused as unsafe: it holds Python objects other than tensors, which could run code when loaded"
    return "it is truncated, corrupt, or not a PyTorch file"


def load_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """One of our checkpoints, or a UserError saying why `path` is not one.

    `weights_only=True` restricts unpickling to tensors and plain containers, so a file
    crafted to run code on load is refused instead of executed.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {str(path)!r} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch.load raises many types for a bad file
        raise UserError(f"cannot read checkpoint {str(path)!r}: {why_unloadable(e)}") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UserError(
            f"{str(path)!r} is not a training checkpoint of this project (missing {', '.join(missing)}); "
            "to start from its weights use --weights instead of --resume"
        )
    return ckpt
