"""What the README and `--help` promise a newcomer, checked: every file the README names is in
the repository, the README stays short, its commands fit a terminal, each `--help` text is
whole, and the metrics.jsonl keys docs/options.md lists are those a run writes. Fast: no
training process starts."""
from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import inspect
import io
import os
import re
import signal
import subprocess
import sys
import types

import pytest
import torch
from conftest import REPO
from test_figures import FIGURE

from multi_train_utils import run_folder
from multi_train_utils.config import get_args_parser
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.train_eval_utils import Evaluation, Trained

README = REPO / "README.md"
MOST_LINES = 200
WIDEST_COMMAND = 100
SCRIPTS = ["train_single_gpu.py", "train_multi_gpu_using_launch.py", "train_multi_gpu_using_spawn.py",
           "predict.py", "export.py"]
# A text cut mid-sentence ends on a word that needs another after it, or on punctuation that
# opens or continues a clause.
DANGLING_WORDS = {"a", "an", "the", "and", "or", "nor", "but", "of", "to", "in", "on", "at", "by", "for", "from",
                  "with", "into", "as", "than", "that", "which", "when", "where", "whose", "its", "their", "is",
                  "are", "be", "if", "then", "so", "per", "via", "each", "every"}
DANGLING_END = tuple(",;:-(/[")
COMMAND_WORDS = ("python", "python3", "torchrun", "pip", "sbatch", "srun", "bash", "git", "OMP_NUM_THREADS=")
# Endings of the repository's own files, as a bare name in the text (not a run's outputs: .pth, .json, .png).
FILE_ENDINGS = (".py", ".md", ".txt", ".sbatch", ".sh", ".cfg", ".toml")


def code_blocks(text: str) -> list[str]:
    """The lines inside ``` fences."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            lines.append(line)
    return lines


def prose(text: str) -> str:
    """The text outside ``` fences."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def tracked_top_level() -> set[str]:
    """The first path component of every file git tracks: what a path must start with to be the
    repository's (`runs/...`, `my_images/` and `dataset/...` are the user's)."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {line.split("/", 1)[0] for line in listed.splitlines() if "/" in line}


def named_paths(text: str) -> dict[str, bool]:
    """Every repository path the text names, each with whether it must be at the repository's top:
    link targets, and the words of code spans and code blocks that start with a folder of the
    repository or are a bare file name of its kind (in a command, a file of the top, where the
    commands run; in a sentence, a file anywhere, such as a module of the package it names)."""
    targets = [t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+://", t)]
    in_prose = [w for span in re.findall(r"`([^`\n]+)`", prose(text)) for w in span.split()]
    in_commands = [w for line in code_blocks(text) for w in line.split()]
    folders = tracked_top_level()
    found = {t: True for t in targets if t}
    for word, at_top in [*((w, False) for w in in_prose), *((w, True) for w in in_commands)]:
        word = word.strip("'\",;:()[]")
        if "://" in word or "*" in word or "<" in word or word.startswith("-"):
            continue
        if "/" in word and word.split("/", 1)[0] in folders:
            found[word] = True
        elif "/" not in word and word.endswith(FILE_ENDINGS) and not word.startswith("."):
            found[word] = found.get(word, False) or at_top
    return found


def missing_paths(text: str) -> list[str]:
    """The named paths that are not in the repository."""
    return sorted(path for path, at_top in named_paths(text).items()
                  if not (REPO / path).exists()
                  and (at_top or not any(".git" not in p.parts for p in REPO.rglob(path))))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_anchors(text: str) -> list[str]:
    """Links to a heading of a page (`docs/x.md#heading`) whose page has no such heading."""
    broken = []
    for page, anchor in re.findall(r"\]\(([^)\s#]*\.md)#([^)\s]+)\)", text):
        target = REPO / page
        if target.is_file():
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", prose(target.read_text()), flags=re.M)}
            if anchor not in headings:
                broken.append(f"{page}#{anchor}")
    return broken


def long_commands(text: str) -> list[str]:
    """Lines of code blocks, and command-line code spans, wider than WIDEST_COMMAND."""
    spans = [s for s in re.findall(r"`([^`\n]+)`", prose(text)) if s.startswith(COMMAND_WORDS)]
    return [line for line in code_blocks(text) + spans if len(line) > WIDEST_COMMAND]


def test_every_file_the_readme_names_is_in_the_repository():
    # flowers.sbatch too: the README's SLURM command runs it from the repository's top.
    text = README.read_text()
    assert "flowers.sbatch" in named_paths(text)
    assert not missing_paths(text), f"the README names files that do not exist: {missing_paths(text)}"
    assert not broken_anchors(text), f"the README links headings that do not exist: {broken_anchors(text)}"


def test_the_readme_is_short_and_its_commands_fit_a_terminal():
    text = README.read_text()
    assert len(text.splitlines()) <= MOST_LINES, f"{len(text.splitlines())} lines, more than {MOST_LINES}"
    assert not long_commands(text), "\n".join(long_commands(text))


def test_the_checks_of_names_and_widths_catch_what_they_look_for():
    text = ("See [the tour](docs/how-it-works.md#no-such-stop) and `docs/nowhere.md`.\n\n```bash\n"
            "sbatch missing.sbatch\npython train_single_gpu.py --data-path my_images" + " --x" * 30 + "\n```\n")
    assert missing_paths(text) == ["docs/nowhere.md", "missing.sbatch"]  # my_images is the user's
    assert broken_anchors(text) == ["docs/how-it-works.md#no-such-stop"]
    assert len(long_commands(text)) == 1
    assert not missing_paths("`python train_single_gpu.py --data-path data/flower_photos_quick`, `runs/x/best.pth`")
    assert not missing_paths("`cluster/`: `check.py`") and missing_paths("```bash\npython check.py\n```")


@functools.cache
def help_outputs() -> dict[str, str]:
    """Each script's `--help`, printed unwrapped (one line per text): its main(), in this process,
    which has torch loaded already (five interpreters loading it took 30 s of a core)."""
    outputs, columns, sigterm = {}, os.environ.get("COLUMNS"), signal.getsignal(signal.SIGTERM)
    os.environ["COLUMNS"] = "1000"
    try:
        for script in SCRIPTS:
            main = importlib.import_module(script.removesuffix(".py")).main  # a launcher sets SIGTERM's handler
            printed, argv, code = io.StringIO(), sys.argv, 0
            sys.argv = [script, "--help"]
            try:
                with contextlib.redirect_stdout(printed):
                    main()  # torchrun's @record turns the SystemExit(0) of --help into a return
            except SystemExit as e:
                code = e.code
            finally:
                sys.argv = argv
            assert code in (0, None), f"{script} --help: exit {code}"
            outputs[script] = printed.getvalue()
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return outputs


def help_texts(script: str) -> list[tuple[str, str]]:
    """(what, text) for the description and each option's and group's help of `script --help`."""
    return parse_help(help_outputs()[script])


def parse_help(out: str) -> list[tuple[str, str]]:
    lines = out.splitlines()
    texts: list[list[str]] = []
    section = ""
    for line in lines[lines.index(""):]:  # after the usage lines
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent == 0 and line.endswith(":"):
            section = line
        elif indent == 0:
            texts.append(["description" if not section else "epilog", line])
        elif indent == 2 and (line.lstrip().startswith("-") or section.startswith("positional")):
            name, _, help_text = line.strip().partition("  ")
            texts.append([name, help_text.strip()])
        elif indent == 2:
            texts.append([f"{section} (the group's description)", line.strip()])
        else:  # the help of an option whose name took the line
            texts[-1][1] = f"{texts[-1][1]} {line.strip()}".strip()
    return [(what, text) for what, text in texts]


def cut_short(what: str, text: str) -> str | None:
    """Why `text` reads as cut mid-sentence, or None."""
    if what == "description" and not text.endswith("."):
        return "the description is no whole sentence: it ends without a period"
    last_word = re.findall(r"[\w'-]+$", text)
    if text.endswith(DANGLING_END) or last_word and last_word[0].lower() in DANGLING_WORDS:
        return f"ends on {text.split()[-1]!r}"
    for opening, closing in ("()", "[]"):
        if text.count(opening) != text.count(closing):
            return f"an unclosed {opening}"
    return None


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_help_text_is_whole_and_states_no_figure(script):
    """Whole sentences; and no measured figure, which would age without its machine beside it."""
    texts = help_texts(script)
    assert texts[0][0] == "description" and len(texts) > 3, texts
    problems = [f"{what}: {text!r}: {why}" for what, text in texts if text and (why := cut_short(what, text))]
    assert not problems, "\n".join(problems)
    assert not FIGURE.findall(help_outputs()[script])


def test_a_help_text_cut_short_is_caught():
    cut = ("usage: predict.py [-h]\n\nClassify images with a trained checkpoint: the top-k classes and\n\n"
           "options:\n  -h, --help  show this help message and exit\n  --top-k K  classes shown (default: 3\n"
           "  --json  one JSON object per line instead of a\n")
    problems = [why for what, text in parse_help(cut) if (why := cut_short(what, text))]
    assert problems == ["the description is no whole sentence: it ends without a period", "an unclosed (",
                        "ends on 'a'"]
    assert cut_short("--x", "image files and folders of images (default: 3)") is None
    assert cut_short("--x", "one sub-folder per class; or train/ and val/ (the split as given)") is None


def documented_metrics_keys() -> set[str]:
    """The keys docs/options.md lists in its metrics.jsonl row."""
    row = next(line for line in (REPO / "docs" / "options.md").read_text().splitlines()
               if line.startswith("| `metrics.jsonl` |"))
    return set(re.findall(r"`([a-z_]+)`", row.split("|")[2]))


def written_metrics_keys() -> set[str]:
    """The keys of a metrics.jsonl line as the code builds it, with --ema: the epoch's record from
    stand-in statistics (evaluate() names the weight average's metrics ema_*)."""
    trained = Trained(1.0, 0.5, 2, 2, 1.0, 0.1, 0.01, (2.0, 1.0, 2.0), 1)
    val = {"val_loss": 1.0, "val_acc": 0.5, "val_correct": 1, "val_total": 2}
    evaluated = Evaluation({**val, **{f"ema_{k}": v for k, v in val.items()}}, seconds=1.0)
    args = get_args_parser("test").parse_args([])
    record = run_folder.epoch_record(1, trained, evaluated, types.SimpleNamespace(train=[("a.jpg", 0)]), args,
                                     DistContext.single())
    added = re.findall(r"\brecord\[[\"'](\w+)[\"']\]\s*=", inspect.getsource(run_folder))
    return set(record) | set(added)


def test_the_documented_metrics_keys_are_those_a_run_writes():
    documented, written = documented_metrics_keys(), written_metrics_keys()
    assert {"train_seen", "data_wait_seconds", "ema_val_acc"} <= written
    assert documented == written, (f"written, not documented: {sorted(written - documented)}; "
                                   f"documented, not written: {sorted(documented - written)}")


def test_the_predicting_page_lists_every_option_of_predict_and_export():
    """docs/predicting-and-plots.md, which the README sends predict.py's users to, names each option."""
    page = (REPO / "docs" / "predicting-and-plots.md").read_text()
    for script in ("predict.py", "export.py"):
        options = {what.split()[0].rstrip(",") for what, _ in help_texts(script) if what.startswith("--")}
        assert options and all(f"`{option}" in page for option in options), (script, options)

