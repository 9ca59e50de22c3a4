"""The commands of a page, as a shell splits them, and what a launcher's own parser, or
torchrun's, makes of each: tests/tour_checks.py's for docs/how-it-works.md, and the README's."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

from conftest import REPO

from multi_train_utils.config import get_args_parser

LAUNCHERS = {"train_single_gpu.py": "single", "train_multi_gpu_using_launch.py": "launch",
             "train_multi_gpu_using_spawn.py": "spawn"}
# How each program that starts launchers reads its own options, before the script's name.
STARTERS = {"torchrun": "torch.distributed.run", "torch.distributed.run": "torch.distributed.run",
            "torch.distributed.launch": "torch.distributed.launch"}
# A redirection (2>&1, > out.log) is no argument of the command before it.
REDIRECTION = re.compile(r"(?<!\S)\d*(?:>>|>&|<&|>|<)\s*(?:&\d+|\S+)")
SHELL_WORDS = {"do", "then", "else", "time", "exec"}


def blocks(text: str, kind: str) -> list[str]:
    """The bodies of the page's fenced blocks whose info string is `kind`."""
    return re.findall(rf"^```{kind}\n(.*?)^```", text, flags=re.M | re.S)


def commands(text: str) -> Iterator[list[str]]:
    """Each simple command of the page's bash blocks, as words: lines joined where they continue,
    split at ; & && | ||, with redirections and the variables set before a command left out."""
    for block in blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(REDIRECTION.sub(" ", line), posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words: list[str] = []
            for token in [*lexer, ";"]:
                if set(token) <= set(lexer.punctuation_chars):
                    while words and (words[0] in SHELL_WORDS or re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
                        words.pop(0)
                    if words:
                        yield words
                    words = []
                else:
                    words.append(token)


def launcher_call(words: list[str]) -> tuple[str | None, list[str], str, list[str]] | None:
    """(starter module, its options, script, the script's options) for a command that starts a
    launcher, or torchrun with anything; None for any other command."""
    program = Path(words[0]).name
    if program == "torchrun":
        starter, rest = STARTERS["torchrun"], words[1:]
    elif re.fullmatch(r"python[\d.]*", program):
        if words[1:2] == ["-m"]:
            if words[2] not in STARTERS:
                return None  # python -m pytest, python -m benchmarks
            starter, rest = STARTERS[words[2]], words[3:]
        else:
            starter, rest = None, words[1:]
    else:
        return None
    script_at = next((i for i, w in enumerate(rest) if Path(w).name in LAUNCHERS), None)
    if script_at is None and starter is not None:  # torchrun --no-python sh -c ...
        script_at = next((i for i, w in enumerate(rest) if not w.startswith("-") and not _is_value_of_option(rest, i)),
                         None)
    if script_at is None:
        return None  # python -c ..., python predict.py ...
    return starter, rest[:script_at], Path(rest[script_at]).name, rest[script_at + 1:]


def _is_value_of_option(words: list[str], i: int) -> bool:
    """Whether words[i] is the value of the option before it (`--nnodes 2`), not the program."""
    return i > 0 and words[i - 1].startswith("-") and "=" not in words[i - 1] and words[i - 1] not in (
        "--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "--module", "-m")


def parse_problem(parse: Callable[[list[str]], argparse.Namespace], argv: list[str],
                  what: str) -> tuple[argparse.Namespace | None, str | None]:
    """What `parse` makes of `argv`, or the last line of its complaint."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parse(argv), None
    except SystemExit:
        complaint = err.getvalue().strip().splitlines() or ["refused"]
        return None, f"{what}: {complaint[-1]}"


def command_problems(words: list[str], laptop: bool = True) -> list[str]:
    """Why a launcher command of the page would not start, as far as parsing can tell; `laptop`:
    and why it would not run on a laptop's CPU, on the bundled sample."""
    call = launcher_call(words)
    if call is None:
        return []
    starter, starter_options, script, options = call
    shown = " ".join(words)
    problems = []
    if starter is not None:  # torchrun's own options, or the legacy launcher's (its --use-env too)
        _, problem = parse_problem(importlib.import_module(starter).parse_args, [*starter_options, script],
                                   f"{shown}\n  {starter}")
        problems += [problem] if problem else []
    if script not in LAUNCHERS:
        return problems  # torchrun --no-python sh -c ...: only torchrun's options are ours to check
    parser = get_args_parser("how-it-works", launcher=LAUNCHERS[script])
    args, problem = parse_problem(parser.parse_args, options, f"{shown}\n  {script}")
    if problem or not laptop:
        return problems + ([problem] if problem else [])
    if not (REPO / args.data_path).is_dir():
        problems.append(f"{shown}\n  --data-path {args.data_path}: not a folder of this repository (the bundled sample?)")
    if args.device != "cpu":
        problems.append(f"{shown}\n  runs on a laptop's CPU only with --device cpu")
    return problems
