"""Checkpoints: what one holds and how a run is restored from it, side by side; written
atomically, read without running code. Also reading the weight files that --weights names.

A checkpoint is everything needed to continue: the unwrapped model's weights, the optimizer,
the loss scaler, the epochs done (and the epoch count --time-budget fixed), the best accuracy
so far, the configuration and the class names. The learning rate and the random draws of
dropout are functions of the step, so there is nothing of them to save.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model import DEFAULT_MODEL, create_model, imagenet_state_dict
from utils import UserError

LAST, BEST = "last.pth", "best.pth"


def make_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    progress: Any, args: argparse.Namespace, class_names: list[str], world_size: int,
                    extra: Any = None, evaluated: Any = None) -> dict[str, Any]:
    """`model` unwrapped (no DDP, not compiled: its keys fit any launcher); `progress`, how far the
    run has come; --ema's average (`extra`); `evaluated`: which weights scored higher (the ones a user
    ships) and the BatchNorm statistics --bn-recalibrate computed for them."""
    return {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
        **dataclasses.asdict(progress), "args": vars(args), "class_names": class_names,
        "world_size": world_size,  # any world size resumes it; a position inside an epoch, this one only
        "better": evaluated.better if evaluated is not None else "model",
        **({"ema": extra.ema.module.state_dict()} if extra is not None and extra.ema is not None else {}),
        **({"evaluated_bn": evaluated.evaluated_bn} if evaluated is not None and evaluated.evaluated_bn else {}),
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


def save_checkpoint(checkpoint: dict[str, Any], output_dir: Path, is_best: bool = False) -> None:
    """last.pth; where the epoch is the best so far, best.pth first and last.pth a hard link to it
    (no byte written twice): a kill between the two leaves the previous epoch's last.pth, whose
    resumed run trains this epoch again, never a best.pth behind the best accuracy last.pth records."""
    if not is_best:
        return save_atomic(checkpoint, output_dir / LAST)
    save_atomic(checkpoint, output_dir / BEST)
    tmp = output_dir / f".{LAST}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(output_dir / BEST, tmp)
    except OSError:  # a file system without hard links: written again, on disk before it is renamed
        return save_atomic(checkpoint, output_dir / LAST)
    os.replace(tmp, output_dir / LAST)


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temporary file beside `path`, on disk before it is renamed over `path`: a kill
    at any moment leaves the old file or the new one, never half of one (the next run removes it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def why_unloadable(error: Exception) -> str:
    """A short reason why torch.load(weights_only=True) failed, without torch's advice to
    retry with weights_only=False, which would run whatever code the file carries."""
    if isinstance(error, pickle.UnpicklingError):
        return "refused as unsafe: it holds Python objects other than tensors, which could run code when loaded"
    return "it is truncated, corrupt, or not a PyTorch file"


def load_checkpoint(path: str | Path, mmap: bool = False,
                    required: tuple[str, ...] = ("model", "optimizer", "scaler", "epoch", "best_acc", "args",
                                                 "class_names")) -> dict[str, Any]:
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
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
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
