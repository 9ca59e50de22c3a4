"""Ours: the project's defaults, read by the project's own parser, and the configurations built on them.

Going through the project's parser and checks (rather than copying its defaults) keeps the
benchmark measuring whatever the launchers would run today.
"""
from __future__ import annotations

from multi_train_utils.config import Plan, check_options, get_args_parser, list_images_of
from utils import DataSplit, split_samples

# Project options that turn each of our configurations on; `ours` is the defaults as they are.
OURS_OPTIONS = {"ours": [], "ours-compile": ["--compile"], "ours-cache": ["--cache"],
                "ours-device": ["--device-augment"], "ours-blurpool": ["--blurpool"], "ours-syncbn": ["--sync-bn"],
                "ours-graph": ["--cuda-graph", "on"], "ours-eager": ["--cuda-graph", "off"]}
CONFIGS = ("seed", *OURS_OPTIONS)
# Configurations whose synthetic-input figure is ours' (the option only changes the loader),
# and whose loader is ours' (the option only changes the model).
SAME_SYNTHETIC_AS_OURS = {"ours-cache", "ours-device"}
SAME_LOADER_AS_OURS = {"ours-compile", "ours-blurpool", "ours-syncbn", "ours-graph", "ours-eager"}
_LAUNCHER = "single"  # whose options the benchmarks read: every launcher shares these
_DESCRIPTION = "the benchmarks' reading of the launchers' options"


def ours_plan(data_path: str, img_size: int, batch_size: int, options: list[str]) -> Plan:
    """The project's defaults plus `options`, checked, with the image list, as a launcher sees them."""
    base = ["--data-path", data_path, "--img-size", str(img_size), "--batch-size", str(batch_size)]
    return plan_of(base + options)


def plan_of(argv: list[str]) -> Plan:
    """A launcher's command line `argv` (its options alone), checked, with the image list, as
    train_single_gpu.py reads it."""
    args = get_args_parser(_DESCRIPTION, _LAUNCHER).parse_args(argv)
    check_options(args, _LAUNCHER)
    return list_images_of(args, _LAUNCHER, verbose=False)


def ours_split(plan: Plan) -> DataSplit:
    """The split a launcher trains a new run on by default: stratified by class, drawn by --seed
    (or the folder's own train/ and val/), no image decoded to make it."""
    args = plan.args
    return split_samples(plan.samples, plan.class_names, args.val_rate, args.seed, plan.val_files)


def missing_option(config: str) -> str | None:
    """Why `config` cannot run with this checkout's options, or None."""
    _, unknown = get_args_parser(_DESCRIPTION, _LAUNCHER).parse_known_args(OURS_OPTIONS.get(config, []))
    return f"this checkout has no {' '.join(unknown)} option" if unknown else None
