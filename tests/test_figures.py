"""Every measured figure in the README and docs/options.md names the machine it was measured on
and what measured it; --help states none (it sends the reader to those pages).

A figure is a number with a unit that only a measurement gives: img/s, seconds, minutes or hours
("32.0 s"), a percentage, a ratio ("3.71x", "3.7 times"), a size (kB to TB, KiB to GiB), a rate
in GB/s or FLOP/s; in a table of the README, also every number with a decimal point or a
thousands separator (a cell whose unit is in its row's label). Output shown in a code block is
what a command printed, not a claim. A figure's paragraph or table, or the one that introduces
it (just before it in its section), must name
- the machine: an H100, H200, A100, EPYC, Xeon, Zen 3 or 4, Emerald Rapids (a figure quoted from
  elsewhere, the original blog's TITAN Xp, is not one of ours); and
- what measured it: a command in backticks (`python ...`, `bash ...`, `torchrun ...`,
  `sbatch ...`, `du ...`, `--check`), a ```bash block, or a link to the pages that hold the
  commands (docs/performance.md, docs/recipe.md, a result file in docs/benchmark/, the
  README's own Performance section).
In docs/options.md each row of the table stands alone: a row's figure names both in the row.
"""
from __future__ import annotations

import json
import re

import pytest
from conftest import REPO

UNIT = (r"\s(?:s|ms|seconds|minutes|min|hours|h|times)|\s?(?:img/s|%|x|×|kB|KiB|MB|MiB|GB|GiB|TB|GB/s"
        r"|[TG]FLOP/s)")
FIGURE = re.compile(rf"(?<![\w.-])\d[\d,]*(?:\.\d+)?(?:{UNIT})(?![\w/])")
TABLE_NUMBER = re.compile(r"(?<![\w.-])(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+)(?![\w.])")
MACHINE = re.compile(r"H100|H200|A100|EPYC|Xeon|Zen ?\d|Emerald Rapids")
MEASURED_BY = re.compile(r"\]\((?:docs/)?(?:performance|recipe)\.md(?:#[\w-]+)?\)|\]\((?:docs/)?benchmark/[^)\s]+\)"
                         r"|\]\(#performance\)|`(?:python|bash|torchrun|sbatch|du) [^`]*`|`--check|^```bash", re.M)


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
        if block.startswith("|") and not rows_alone and (figures or re.search(r"^\|[^|]*(img/s|accuracy)", block, re.M)):
            figures += TABLE_NUMBER.findall(block)
        if block.startswith("```") or not figures:
            continue
        introduced = i > 0 and found[i - 1][0] == section and not rows_alone
        near = "\n".join(b for _, b in found[i - 1 if introduced else i:i + 1])
        lacks = [what for what, pattern in (("the machine", MACHINE), ("what measured it", MEASURED_BY))
                 if not pattern.search(near)]
        if lacks:
            problems.append(f"{', '.join(figures[:3])} in {block[:90]!r}... names not {' nor '.join(lacks)}")
    return problems


@pytest.mark.parametrize("page", ["README.md", "docs/options.md"])
def test_every_figure_names_its_machine_and_what_measured_it(page):
    problems = figures_without_origin((REPO / page).read_text(), rows_alone=page.endswith("options.md"))
    assert not problems, "\n".join(problems)


def test_a_figure_without_its_machine_or_its_command_is_caught():
    assert figures_without_origin("Training ran at 123 img/s, 2.5x the seed.") == [
        "123 img/s, 2.5x in 'Training ran at 123 img/s, 2.5x the seed.'... names not the machine nor what measured it"]
    assert len(figures_without_origin("On an H200 it took 32.0 s.")) == 1
    assert len(figures_without_origin("It took 32.0 s ([performance](docs/performance.md)).")) == 1
    assert not figures_without_origin("On an H200 it took 32.0 s ([performance](docs/performance.md)).")
    assert not figures_without_origin("`python -m benchmarks endtoend` on an H200:\n\n| a | b |\n|---|---|\n"
                                      "| 32.0 s | 3.7x |")
    # Only the paragraph that introduces a table speaks for it, not whatever follows it.
    assert figures_without_origin("On an H200:\n\n| a | b |\n|---|---|\n| 32.0 s | 3.7x |\n\n"
                                  "`python -m benchmarks endtoend` measured it.")
    assert figures_without_origin("On an H200 ([p](docs/performance.md)):\n\nSomething else.\n\n"
                                  "It took 32.0 s.")  # two paragraphs up is out of reach
    # A comparison with a figure quoted from elsewhere, or a link to any page, names neither.
    assert figures_without_origin("The blog took 141.5 s on a TITAN Xp ([see](docs/options.md)).")
    # In a table of measurements, a cell's unit may sit in its row's label.
    assert figures_without_origin("| | ours |\n|---|---|\n| training img/s | 8,586 |") == [
        "8,586 in '| | ours |\\n|---|---|\\n| training img/s | 8,586 |'... names not the machine nor what measured it"]
    assert figures_without_origin("| `--x` | 32.0 s on an H200 |\n| `--y` | [p](p.md) |", rows_alone=True)
    assert not figures_without_origin("```output\n19.5 img/s, 20.5s\n```")  # printed, not claimed
    assert not figures_without_origin("(600s, 10m, 1.5h): a duration given, not measured")


TORCH_STATED = re.compile(r"\btorch (\d+\.\d+(?:\.\d+)?)")
RESULT_FILE = re.compile(r"(?<![\w/])(?:docs/)?benchmark/([\w./-]+?\.json)(?![\w.])")


def recorded_torch(result: str) -> str | None:
    """The torch version a result file in docs/benchmark/ records for its machine."""
    path = REPO / "docs" / "benchmark" / result
    if not path.is_file():
        return None  # a file a command would write (--out), not a result
    machine = json.loads(path.read_text()).get("machine")
    if isinstance(machine, dict):
        return machine.get("torch")
    found = TORCH_STATED.search(machine or "")
    return found and found[1]


def torch_versions_unlike_their_results(text: str) -> list[str]:
    """Each result file a section names whose recorded torch is not the version the section
    states (or, where it states none, the section around it)."""
    sections: list[tuple[int, str, list[str]]] = []  # (heading level, heading, lines)
    fenced = False
    sections.append((0, "(top)", []))
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        heading = re.match(r"(#+) ", line)
        if heading and not fenced:
            sections.append((len(heading[1]), line, []))
        else:
            sections[-1][2].append(line)
    problems = []
    for i, (level, heading, lines) in enumerate(sections):
        chain = [i] + [j for j in range(i - 1, -1, -1) if sections[j][0] < level
                       and all(sections[k][0] > sections[j][0] for k in range(j + 1, i))]
        stated = next((found for j in chain if (found := TORCH_STATED.findall("\n".join(sections[j][2])))), [])
        for result in sorted(set(RESULT_FILE.findall("\n".join(lines)))):
            recorded = recorded_torch(result)
            if recorded and not any(recorded == v or recorded.startswith(v + ".") or recorded.startswith(v + "+")
                                    for v in stated):
                problems.append(f"{heading}: {result} ran on torch {recorded}, the section says {stated or 'none'}")
    return problems


@pytest.mark.parametrize("page", ["README.md", "docs/performance.md", "docs/recipe.md"])
def test_a_figures_torch_version_is_its_results(page):
    problems = torch_versions_unlike_their_results((REPO / page).read_text())
    assert not problems, "\n".join(problems)


def test_a_torch_version_unlike_the_results_is_caught():
    assert torch_versions_unlike_their_results(
        "## A\n\nOn the Zen 4 VM, torch 2.14.1 ([t](benchmark/cpu-throughput.json)).") == [
        "## A: cpu-throughput.json ran on torch 2.15.0+cu132, the section says ['2.14.1']"]
    assert torch_versions_unlike_their_results("## A\n\nNo version ([t](benchmark/accuracy.json)).")
    # The nearest section that states a version speaks for its subsections.
    assert not torch_versions_unlike_their_results(
        "## A\n\ntorch 2.15.0\n\n### B\n\n[t](benchmark/cpu-throughput.json)\n\n```\n# not a heading\n```\n"
        "[d](benchmark/cpu-data.json)")
    assert torch_versions_unlike_their_results(
        "## A\n\ntorch 2.15.0\n\n## B\n\n[t](benchmark/cpu-throughput.json)")  # a sibling does not
