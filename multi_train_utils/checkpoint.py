"""Checkpoints: what one holds and how a run is restored from it, side by side; written
atomically, read without running code. Also reading the weight files that --weights names.

A checkpoint is everything needed to continue: the unwrapped model's weights, the optimizer,
the loss scaler, the epochs done (and the epoch count --time-budget fixed), the best accuracy
so far, the configuration and the class names. The learning-rate schedule is a function of the
step, so there is nothing of it to save.
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model import DEFAULT_MODEL, create_model, imagenet_state_dict
from multi_train_utils.progress import Progress
from utils import UserError

REQUIRED_KEYS = ("model", "optimizer", "scaler", "epoch", "best_acc", "args", "class_names")


def make_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    progress: Progress, args: argparse.Namespace, class_names: list[str], world_size: int,
                    ema: nn.Module | None = None, better: str = "model",
                    evaluated_bn: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """`model` is the unwrapped one (no DDP, not compiled): its keys then fit any launcher.
    `ema`: the weight average, when the run keeps one; `better`: which of "model" and "ema"
    scored higher in this epoch's evaluation, the weights a user of this file ships;
    `evaluated_bn`: the BatchNorm statistics that evaluation recomputed for those (--bn-recalibrate)."""
    return {
        "model": model.state_dict(),
        **({"ema": ema.state_dict()} if ema is not None else {}),
        "better": better,
        **({"evaluated_bn": evaluated_bn} if evaluated_bn is not None else {}),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": progress.epoch,
        "best_acc": progress.best_acc,
        "steps_in_epoch": progress.steps_in_epoch,
        "epoch_sums": list(progress.epoch_sums),
        "epoch_seconds": progress.epoch_seconds,
        "budget_epochs": progress.budget_epochs,
        "seconds_used": progress.seconds_used,
        "slowest_train": progress.slowest_train,
        "first_epoch": list(progress.first_epoch) if progress.first_epoch else None,
        "args": vars(args),
        "class_names": class_names,
        "world_size": world_size,  # any world size resumes it; a position inside an epoch, this one only (resume.py)
    }


def architecture(checkpoint: dict[str, Any]) -> str:
    return checkpoint["args"].get("model", DEFAULT_MODEL)  # checkpoints from before --model: ResNet34


def blurpool(checkpoint: dict[str, Any]) -> bool:
    """Whether the model was trained with --blurpool: its weights load into either model, so the
    flag, not the state dict, says which one computes what it learnt."""
    return checkpoint["args"].get("blurpool", False)


def shipped_weights(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights a user ships: the better of the model and its average (--ema), with the
    BatchNorm statistics its evaluation recomputed (--bn-recalibrate), if it did. The
    checkpoint's "model" keeps the training statistics, which a resumed run goes on from."""
    return {**checkpoint[checkpoint.get("better", "model")], **checkpoint.get("evaluated_bn", {})}


def model_from_checkpoint(checkpoint: dict[str, Any]) -> nn.Module:
    """The trained model a checkpoint holds (its shipped weights), on the CPU, in eval mode."""
    model = create_model(len(checkpoint["class_names"]), architecture(checkpoint), blurpool=blurpool(checkpoint))
    model.load_state_dict(shipped_weights(checkpoint))
    return model.eval()


def check_architecture(checkpoint: dict[str, Any], args: argparse.Namespace, source: str) -> None:
    """A checkpoint's weights fit the model asked for, or a UserError says why not."""
    if architecture(checkpoint) != args.model:
        raise UserError(f"{source} holds a {architecture(checkpoint)}, not the --model {args.model} asked for")
    if blurpool(checkpoint) != args.blurpool:
        trained = "with" if blurpool(checkpoint) else "without"
        raise UserError(f"{source} was trained {trained} --blurpool: give the same model ({trained} --blurpool)")


def check_classes(checkpoint: dict[str, Any], class_names: list[str], source: str) -> None:
    if checkpoint["class_names"] != class_names:
        raise UserError(f"{source} was trained on classes {checkpoint['class_names']}, but the data has {class_names}")


def snapshot(obj: Any) -> Any:
    """A copy of a checkpoint, taken now, in host memory: training goes on changing the tensors
    it names while a background writer saves the copy. GPU tensors go to pinned memory, all
    copies queued first and waited for once, on a stream of their own: a pinned block records an
    event on the stream it was copied on when it is freed (by the writer thread, later), and that
    must not be the stream whose steps may be captured into a CUDA graph at that moment."""
    copies: list[torch.Tensor] = []
    streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu":
                return value.detach().clone()
            if value.device not in streams:
                streams[value.device] = torch.cuda.Stream(value.device)
                streams[value.device].wait_stream(torch.cuda.current_stream(value.device))  # the values are final
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            with torch.cuda.stream(streams[value.device]):
                copies.append(host.copy_(value.detach(), non_blocking=True))
            return host
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value

    result = copy(obj)
    if copies:
        torch.cuda.synchronize()
    return result


def save_atomic(obj: Any, path: Path) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it: a crash or a kill
    at any moment leaves either the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, new_file_mode())  # mkstemp makes it private to the owner; the umask decides, as for any file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def new_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0o644 under the usual 022,
    0o664 under a group's 002), read without os.umask(), which would change it for every thread
    a moment."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):  # not Linux, or a kernel before 4.7
        umask = 0o022
    return 0o666 & ~umask


def copy_atomic(src: Path, dst: Path) -> None:
    """`dst` becomes a copy of `src`: a hard link where the file system allows (no bytes
    written), else a real copy, either way swapped in by rename."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:  # the copy's bytes on disk before the rename makes them best.pth
            os.fsync(f.fileno())
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


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Model weights from a plain state dict or from one of our checkpoints, keys as the bare
    model names them. The file is mapped, not read, so checking it costs little."""
    if not Path(path).is_file():
        raise UserError(f"weights file {path!r} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch.load raises many types for a bad file
        raise UserError(f"cannot read weights {path!r}: {why_unloadable(e)}") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = shipped_weights(obj)  # one of our checkpoints
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{path!r} holds no state dict of tensors")
    return {_unwrapped_key(k): v for k, v in obj.items()}


def _unwrapped_key(key: str) -> str:
    """A key as the bare model names it. DDP prefixes every key with `module.` and
    torch.compile with `_orig_mod.`, nested in whichever order the model was wrapped."""
    while key.startswith(("module.", "_orig_mod.")):
        key = key.split(".", 1)[1]
    return key


def load_weights(model: nn.Module, source: str, log: Callable[[str], None], architecture: str = DEFAULT_MODEL) -> None:
    """Load `source` (a file, or `imagenet`: the default ImageNet weights of `architecture`)
    into `model`, skipping tensors whose shape differs (the 1000-class ImageNet head,
    typically), and say what was loaded and skipped."""
    if source == "imagenet":
        try:
            state = imagenet_state_dict(architecture)
        except Exception as e:  # URLError and friends: offline, proxy, no disk
            raise UserError(
                f"could not download torchvision's ImageNet weights for {architecture} ({type(e).__name__}: {e}); "
                f"offline, save them on a machine online with torch.save(torchvision.models.get_model_weights("
                f"{architecture!r}).DEFAULT.get_state_dict(), PATH) and pass PATH as --weights"
            ) from None
    else:
        state = read_state_dict(source)
    own = model.state_dict()
    loadable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    skipped = sorted(k for k in state if k not in loadable)
    missing = sorted(k for k in own if k not in loadable)
    if not loadable:
        raise UserError(f"{source!r} has no tensor that fits {architecture} (were they trained as another model?)")
    model.load_state_dict(loadable, strict=False)
    log(
        f"weights from {source}: loaded {len(loadable)} tensors, skipped {len(skipped)}"
        + (f" ({', '.join(skipped)})" if skipped else "")
        + (f"; kept initial values for {', '.join(missing)}" if missing else "")
    )
