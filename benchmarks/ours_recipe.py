"""Ours: the project's defaults, read by the project's own parser, and the configurations built on them.

Going through the project's parser and `prepare` (rather than copying its defaults) keeps the
benchmark measuring whatever the launchers would run today.
"""
from __future__ import annotations

from multi_train_utils.config import Plan, get_args_parser, check_and_list_images

# Project options that turn each of our configurations on; `ours` is the defaults as they are.
OURS_OPTIONS = {"ours": [], "ours-compile": ["--compile"], "ours-cache": ["--cache"],
                "ours-device": ["--device-augment"], "ours-blurpool": ["--blurpool"], "ours-syncbn": ["--sync-bn"],
                "ours-graph": ["--cuda-graph", "on"], "ours-eager": ["--cuda-graph", "off"]}
CONFIGS = ("seed", *OURS_OPTIONS)
# Configurations whose synthetic-input figure is ours' (the option only changes the loader),
# and whose loader is ours' (the option only changes the model).
SAME_SYNTHETIC_AS_OURS = {"ours-cache", "ours-device"}
SAME_LOADER_AS_OURS = {"ours-compile", "ours-blurpool", "ours-syncbn", "ours-graph", "ours-eager"}
_PROG = "benchmark"  # the launcher name the project's parser and `prepare` are given


def ours_plan(data_path: str, img_size: int, batch_size: int, options: list[str]) -> Plan:
    """The project's defaults plus `options`, checked, with the image list, as a launcher sees them."""
    base = ["--data-path", data_path, "--img-size", str(img_size), "--batch-size", str(batch_size)]
    return check_and_list_images(get_args_parser(_PROG).parse_args(base + options), _PROG, verbose=False)


def missing_option(config: str) -> str | None:
    """Why `config` cannot run with this checkout's options, or None."""
    _, unknown = get_args_parser(_PROG).parse_known_args(OURS_OPTIONS.get(config, []))
    return f"this checkout has no {' '.join(unknown)} option" if unknown else None
