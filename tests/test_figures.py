"""Every measured figure in the README and docs/options.md names the machine it was measured on
and what measured it; --help states none (it sends the reader to those pages).

A figure is a number with a unit that only a measurement gives: img/s, seconds or minutes
("32.0 s"), a percentage, a ratio ("3.71x"), a size in MB/GB/MiB/GiB, TFLOP/s. Output shown in
a code block is what a command printed, not a claim. A figure's paragraph, or the paragraph or
table just before or after it in its section, must name
- the machine: an H100, H200, A100, TITAN, EPYC, Xeon, Zen 3 or 4, Emerald Rapids; and
- what measured it: a command in backticks (`python ...`, `bash ...`, `torchrun ...`,
  `sbatch ...`, `--check`), a ```bash block, or a link to a page or a result file that holds
  the command (docs/*.md, docs/benchmark/*.json, a section of the same page).
In docs/options.md each row of the table stands alone: a row's figure names both in the row.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO

FIGURE = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?(?:\s(?:s|ms|minutes)|\s?(?:img/s|%|x|MiB|GiB|MB|GB|TFLOP/s))"
                    r"(?![\w/])")
MACHINE = re.compile(r"H100|H200|A100|TITAN|EPYC|Xeon|Zen ?\d|Emerald Rapids")
MEASURED_BY = re.compile(r"\]\((?:\.\./|docs/)?[\w/.-]*\.(?:md|json)(?:#[\w-]+)?\)|\]\(#[\w-]+\)"
                         r"|`(?:python|bash|torchrun|sbatch) [^`]*`|`--check|^```bash", re.M)


def blocks(text: str, rows_alone: bool = False) -> list[tuple[str, str]]:
    """The page's paragraphs, tables and code blocks, each with the heading of its section
    (`rows_alone`: each table row a block of its own)."""
    found: list[tuple[str, str]] = []
    section, lines, fenced = "", [], False

    def close() -> None:
        if lines:
            found.append((section, "\n".join(lines)))
            lines.clear()
    for line in text.splitlines():
        if line.startswith("```"):
            if not fenced:
                close()
            fenced = not fenced
            lines.append(line)
            if not fenced:
                close()
        elif fenced:
            lines.append(line)
        elif line.startswith("#"):
            close()
            section = line
        elif not line.strip():
            close()
        elif rows_alone and line.startswith("|"):
            close()
            found.append((section, line))
        else:
            lines.append(line)
    close()
    return found


def figures_without_origin(text: str, rows_alone: bool = False) -> list[str]:
    """Each block whose figures lack a machine or a measuring command nearby, and what it lacks."""
    found = blocks(text, rows_alone)
    problems = []
    for i, (section, block) in enumerate(found):
        figures = FIGURE.findall(block)
        if block.startswith("```") or not figures:
            continue
        reach = 0 if rows_alone else 1
        near = "\n".join(b for k, (s, b) in enumerate(found) if s == section and abs(k - i) <= reach)
        lacks = [what for what, pattern in (("the machine", MACHINE), ("what measured it", MEASURED_BY))
                 if not pattern.search(near)]
        if lacks:
            problems.append(f"{', '.join(figures[:3])} in {block[:90]!r}... names not {' nor '.join(lacks)}")
    return problems


@pytest.mark.parametrize("page", ["README.md", "docs/options.md"])
def test_every_figure_names_its_machine_and_what_measured_it(page):
    problems = figures_without_origin((REPO / page).read_text(), rows_alone=page.endswith("options.md"))
    assert not problems, "\n".join(problems)


def test_help_states_no_figure():
    help_text = subprocess.run([sys.executable, "train_single_gpu.py", "--help"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout
    assert not FIGURE.findall(help_text)


def test_a_figure_without_its_machine_or_its_command_is_caught():
    assert figures_without_origin("Training ran at 123 img/s, 2.5x the seed.") == [
        "123 img/s, 2.5x in 'Training ran at 123 img/s, 2.5x the seed.'... names not the machine nor what measured it"]
    assert len(figures_without_origin("On an H200 it took 32.0 s.")) == 1
    assert len(figures_without_origin("It took 32.0 s ([performance](docs/performance.md)).")) == 1
    assert not figures_without_origin("On an H200 it took 32.0 s ([performance](docs/performance.md)).")
    assert not figures_without_origin("On an H200:\n\n| a | b |\n|---|---|\n| 32.0 s | 3.7x |\n\n"
                                      "`python -m benchmarks endtoend` measured it.")
    assert figures_without_origin("| `--x` | 32.0 s on an H200 |\n| `--y` | [p](p.md) |", rows_alone=True)
    assert not figures_without_origin("```output\n19.5 img/s, 20.5s\n```")  # printed, not claimed
    assert not figures_without_origin("(600s, 10m, 1.5h): a duration given, not measured")
