"""Where the ranks meet, recorded from real runs (--trace-collectives) and held against what the
project says: the torchrun launcher with 2 gloo processes, on the defaults and on the options
that change where the ranks meet, at the smallest sizes. Each recorded collective's launcher line
must name its kind in its comment, and the tour's "Where the ranks meet" table must list that
line's call with that kind; each of the table's rows must have been recorded; and every rank's
list must be the same (the rule of collectives)."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
from conftest import FAST, FAST_DEFAULT_WORKERS, REPO, SMALL_MODEL, call_main, ok, train, user_error

import train_multi_gpu_using_launch
import train_single_gpu

from test_meeting_points import TOUR, comment_of, leading_to_collectives, meeting_lines, tour_table

LAUNCHER = REPO / "train_multi_gpu_using_launch.py"
# The words a comment or the tour uses for each kind.
WORDS = {"all_reduce": r"all_reduce|all-reduce", "broadcast": r"broadcast", "all_gather": r"all_gather",
         "barrier": r"barrier"}
# The runs recorded, in order (a later one may go on from an earlier one's folder): their name
# and options. Together they reach every line of the table but --check's, whose collectives
# are those of a job of its own (its own rendezvous, before training would join the group).
RUNS = {
    "defaults": ["--epochs", "1"],
    "resumed": ["--epochs", "2", "--resume", "auto"],  # in the defaults' folder
    "eval-only": ["--eval-only", "--resume", "{defaults}/last.pth"],
    "options": ["--epochs", "2", "--sync-bn", "--ema", "--bn-recalibrate", "8", "--accum-steps", "2",
                "--time-budget", "10m", "--cache", "--device-augment", "--check-images", "--report"],
}
# Neither is a SIGTERM's stop, whose barrier tests/test_preemption.py makes happen for real; nor is
# the group's start, which meets in C++ (gloo's connections to every peer, NCCL's communicator):
# no Python-level collective for the recorder to see.
NOT_RECORDED = {"check", "save_position_and_exit", "init_process_group"}
# The defaults' run keeps the default loader workers (processes of their own, which meet no one);
# the others take none, to stay small.


def read_list(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, tuple[list[dict], list[dict], str]]:
    """Each run's rank 0 list, rank 1 list and printed output."""
    root = tmp_path_factory.mktemp("traced")
    folders = {"defaults": root / "defaults", "resumed": root / "defaults", "eval-only": root / "eval-only",
               "options": root / "options"}
    found = {}
    for name, options in RUNS.items():
        options = [o.format(defaults=folders["defaults"]) for o in options]
        result = ok(train("launch", folders[name], "--trace-collectives", *SMALL_MODEL, *options, nproc=2,
                          fast=FAST_DEFAULT_WORKERS if name == "defaults" else FAST, timeout=300))
        lists = folders[name] / "collectives"
        found[name] = (read_list(lists / "rank0.tsv"), read_list(lists / "rank1.tsv"), result.stdout)
    return found


def table() -> dict[str, str]:
    """The tour's "Where the ranks meet": each row's call and its collectives column."""
    return dict(tour_table(TOUR.read_text()))


def calls_by_line() -> dict[int, str]:
    return dict(meeting_lines(LAUNCHER, leading_to_collectives()))


@pytest.mark.slow
@pytest.mark.floor  # on the oldest torch too: the recorder wraps private names of torch.distributed
def test_every_rank_makes_the_same_collectives_in_the_same_order(recorded):
    for name, (rank0, rank1, _) in recorded.items():
        assert rank0, f"{name}: nothing recorded"
        strip = [[(r["kind"], r["call"], r["bytes"], r["line"]) for r in rows] for rows in (rank0, rank1)]
        assert strip[0] == strip[1], f"{name}: rank 0 and rank 1 met differently"


def contradictions(lists: dict[str, list[dict]]) -> tuple[list[str], set[str]]:
    """What rank 0's recorded lists (by run) contradict: a collective whose launcher line's
    comment (for an option's own, the comment or its pointer to the tour) or whose tour row does
    not name its kind. With the calls reached."""
    lines = LAUNCHER.read_text().splitlines()
    calls, rows = calls_by_line(), table()
    problems, seen = [], set()
    for name, rank0 in lists.items():
        for r in rank0:
            line, kind = int(r["line"]), r["kind"]
            if not line:
                problems.append(f"{name}: {kind} via {r['via']} came from no launcher line")
                continue
            call = calls.get(line)
            if call is None:
                problems.append(f"{name}: line {line} ({lines[line - 1].strip()}) made a {kind}, "
                                "but the meeting points' analysis does not see it")
                continue
            seen.add(call)
            comment = comment_of(lines, line)
            # An option's own collectives may be left to the tour's row, where the comment says so.
            told = re.search(rf"\b({WORDS[kind]})", comment) or (name == "options" and "tour" in comment)
            if not told:
                problems.append(f"{name}: line {line} {call}() made a {kind} (via {r['via']}); its comment does not say so")
            if call not in rows:
                problems.append(f"{name}: {call}() made a {kind}; the tour's table has no row for it")
            elif not re.search(rf"\b({WORDS[kind]})", rows[call]):
                problems.append(f"{name}: {call}() made a {kind} (via {r['via']}); the tour's row does not say so")
    return sorted(set(problems)), seen


@pytest.mark.slow
@pytest.mark.floor  # on the oldest torch too: the recorder wraps private names of torch.distributed
def test_each_recorded_collective_is_named_on_its_line_and_in_the_tour(recorded):
    problems, seen = contradictions({name: rank0 for name, (rank0, _, _) in recorded.items()})
    problems += [f"the tour lists {call}(), which no recorded run reached" for call in table()
                 if call not in seen | NOT_RECORDED]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_rank_0_prints_each_epochs_collectives_by_launcher_line(recorded):
    rank0, _, out = recorded["defaults"]
    printed = re.search(r"collectives of the start and epoch 1: (\d+) on rank 0", out)
    after = re.search(r"collectives after the epochs: (\d+) on rank 0", out)  # none without --report
    assert int(printed[1]) + (int(after[1]) if after else 0) == len(rank0)
    ddp = [r for r in rank0 if "allreduce" in r["via"]]  # DDP's gradient buckets, through torch's hook
    assert ddp and all(calls_by_line()[int(r["line"])] == "train_one_epoch" for r in ddp)


def test_the_one_process_launcher_does_not_offer_it(capsys):
    """One process meets no one: its parser has no --trace-collectives to offer."""
    with pytest.raises(SystemExit) as exit_info:
        call_main(train_single_gpu.main, ["--data-path", "data/flower_photos_sample", "--trace-collectives"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --trace-collectives" in capsys.readouterr().err


def test_check_refuses_it_rather_than_record_nothing(capsys):
    line = user_error(train_multi_gpu_using_launch.main, ["--data-path", "data/flower_photos_sample", "--check",
                                                          "--trace-collectives"], capsys)
    assert "--check trains none" in line


def count(rows: list[dict], line_call: str, via: str, calls: dict[int, str]) -> int:
    return sum(1 for r in rows if calls.get(int(r["line"])) == line_call and via in r["via"])


@pytest.mark.slow
def test_the_counts_the_tour_and_the_comments_state(recorded):
    """Per epoch: DDP's buffer broadcast in the forward of each step's first batch (with
    --accum-steps 2, every other batch); rank 0's BatchNorm statistics in two broadcasts per
    model (one per dtype); one all_reduce of the sums per model evaluated and per epoch trained;
    a look after the first step and at the last, and one after an evaluation's first batch."""
    calls = calls_by_line()
    for name, epochs, models, batches_per_step in (("defaults", 1, 1, 1), ("options", 2, 2, 2)):
        rows, _, out = recorded[name]
        batches = int(re.search(r"(\d+) batches a process", out)[1])
        steps = -(-batches // batches_per_step)
        assert count(rows, "train_one_epoch", "_distributed_broadcast_coalesced", calls) == epochs * steps, name
        assert count(rows, "evaluate", "evaluate > broadcast_buffers", calls) == epochs * 2 * models, name
        assert count(rows, "evaluate", "evaluate > all_reduce_sum", calls) == epochs * models, name
        assert count(rows, "evaluate", "evaluate > all_reduce_min", calls) >= epochs * models, name
        assert count(rows, "train_one_epoch", "train_one_epoch > all_reduce_sum", calls) == epochs, name
        assert count(rows, "train_one_epoch", "all_reduce_min", calls) >= 2 * epochs, name
    rows, _, _ = recorded["options"]  # --bn-recalibrate: two broadcasts per model before each evaluation
    assert count(rows, "evaluate", "BatchNormRecalibration.__call__ > broadcast_buffers", calls) == 2 * 2 * 2


def test_the_tours_recorded_epoch_names_the_launchers_lines_as_they_are():
    """The tour's printed example names launcher lines: each must still be the call it shows."""
    block = re.search(r"```output\ncollectives of the start and epoch 1:.*?```", TOUR.read_text(), flags=re.S)
    assert block, "the tour shows a recorded epoch"
    calls = calls_by_line()
    for line, via in re.findall(r"^  line +(\d+): .* via (\S+)", block[0], flags=re.M):
        expected = "DistributedDataParallel" if via.startswith("torch:") else via
        assert calls.get(int(line)) == expected, (line, via, calls.get(int(line)))
