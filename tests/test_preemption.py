"""Preemption: SIGTERM (what SLURM sends ahead of a time limit or a preemption, and Kubernetes
on eviction) during training or evaluation stops every rank at the same step; rank 0 saves the
position inside the epoch and writes preempted.txt; the job exits 75; `--resume auto` goes on
from that step and ends as if nothing had happened. Before the training loop there is nothing to
save: a SIGTERM ends the process at once, as the signal's default does."""
from __future__ import annotations

import argparse
import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (REPO, FAST_DEFAULT_WORKERS, SAMPLE, SMALL_MODEL, group_of, kill_group, launcher_cmd, metrics, ok,
                      start, train, where_they_wait)

from model import create_model
from multi_train_utils import train_eval_utils
from multi_train_utils.checkpoint import load_checkpoint, make_checkpoint
from multi_train_utils.config import get_args_parser
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.resume import restore_training
from multi_train_utils.train_eval_utils import (Evaluation, Extras, Progress, Trained, build_optimizer, next_look,
                                                train_one_epoch)
from my_dataset import EpochKeys, MyDataSet, build_transform
from utils import Preempted, list_images

EXIT_PREEMPTED = Preempted.exit_code
# Batch 2: an epoch of the sample is 47 steps in one process and 23 in each of two, so that
# the loop's looks (after the first step, then every 20) fall inside epochs, where a stop is
# hardest to resume.
SMALL_STEPS = ["--epochs", "2", "--batch-size", "2", *SMALL_MODEL]
# The one-process run adds every option of the recipe that has state or randomness of its own:
# a stop inside an epoch must keep each one's place too (the weight average, the mixing and
# augmentation draws, the accumulated half step, the ramp of image sizes).
RECIPE = ["--ema", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--auto-augment", "ta_wide",
          "--random-erase", "0.25", "--img-size", "48", "--min-img-size", "32", "--ramp-epochs", "2",
          "--clip-grad-norm", "2", "--accum-steps", "2", "--val-img-size", "56", "--tta"]
# A job of several processes trains a model with dropout: each rank's own draws must be kept by a stop.
DROPOUT = ["--model", "mobilenet_v3_small"]
STOPPED = re.compile(r"stopped: SIGTERM: every process stopped after step (\d+) of epoch (\d+)")


def stopped_job(proc, timeout: float = 120) -> tuple[int, str]:
    """The signalled job's exit code and stderr; where its processes wait if it has not ended."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job did not end {timeout} s after the signal:\n{where_they_wait(group_of(proc))}"
                             ) from None
    return code, proc.stderr.read()


def steps_of(world_size: int) -> list[str]:
    return SMALL_STEPS + (RECIPE if world_size == 1 else DROPOUT)


def trained(seconds: float, images: int = 10) -> Trained:
    return Trained(1.0, 0.5, images, images, seconds, 0.0, 0.1, (1.0, 5.0, float(images)), 5)


def test_a_position_carries_the_epochs_time_and_the_next_pass_skips_what_was_trained():
    """The pieces a stop and a resume rest on: the loader's next pass leaves out the samples
    trained before the stop, once; an epoch's end resets the position and counts its seconds;
    a position saved after 5.5 s of epoch 1 and resumed counts them in epoch 1's time."""
    class Indices(torch.utils.data.Sampler):
        epoch = 3

        def __iter__(self):
            return iter(range(10))

        def __len__(self):
            return 10

    keys = EpochKeys(Indices())
    keys.skip_next_pass(4)
    assert len(keys) == 6 and list(keys) == [(3, i) for i in range(4, 10)]
    assert len(keys) == 10 and list(keys) == [(3, i) for i in range(10)]  # the next pass whole again
    progress = Progress(2, 0.5, 7, steps_in_epoch=3, epoch_sums=(1.0, 2.0, 3.0), seconds_used=30.0, slowest_train=9.0)
    is_best = progress.finish_epoch(3, trained(8.0), Evaluation({"val_acc": 0.6}, seconds=2.0))
    assert is_best and (progress.epoch, progress.steps_in_epoch, progress.epoch_sums, progress.best_acc) == (
        3, 0, (0.0, 0.0, 0.0), 0.6)
    assert (progress.seconds_used, progress.slowest_train, progress.first_epoch) == (40.0, 9.0, None)
    # Stopped inside epoch 1 after 5.5 s of training, at its last step, and resumed: --time-budget's
    # count takes epoch 1's time before and after the stop, as its checkpoint carries it.
    model = torch.nn.Linear(2, 2)
    optimizer, scaler = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False)
    args = argparse.Namespace(batch_size=2, accum_steps=1)
    stopped = Progress(0, -1.0, 11, steps_in_epoch=5, epoch_sums=(1.0, 2.0, 95.0), epoch_seconds=5.5)
    checkpoint = make_checkpoint(model, optimizer, scaler, stopped, args, ["a", "b"], world_size=1)
    loader = torch.utils.data.DataLoader(list(range(20)), batch_size=2, sampler=EpochKeys(Indices()))
    resumed = restore_training({**checkpoint, "loaded_from": "last.pth"}, Progress(last_epoch=11), optimizer, scaler,
                               Extras(), loader, False, args, DistContext.single())
    assert (resumed.epoch, resumed.steps_in_epoch, resumed.epoch_sums) == (0, 5, (1.0, 2.0, 95.0))
    assert len(loader.sampler) == 0  # the 10 indices of the pass: 5 steps of 2 trained before the stop
    resumed.finish_epoch(1, trained(0.01, 95), Evaluation({"val_acc": 0.4}, seconds=1.0))
    assert resumed.first_epoch == (5.51, 1.0) and resumed.seconds_used == 6.51 and resumed.epoch_seconds == 0.0


def some_batches() -> tuple[argparse.Namespace, list[tuple[torch.Tensor, torch.Tensor]]]:
    args = get_args_parser("test").parse_args(["--data-path", str(SAMPLE), "--epochs", "1", "--amp", "off",
                                               "--no-channels-last"])
    _, samples = list_images(str(SAMPLE))
    dataset = MyDataSet(samples[::12], build_transform(32, train=True), 32, seed=0)
    batches = [[dataset[(1, i)] for i in range(j, j + 2)] for j in range(0, 10, 2)]
    return args, [(torch.stack([x for x, _ in b]), torch.tensor([y for _, y in b])) for b in batches]


def fresh(args) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = create_model(5)
    return model, *build_optimizer(model, args, None)


@pytest.mark.slow
def test_stopping_inside_an_epoch_and_going_on_equals_the_whole_epoch(monkeypatch):
    """In one process: train an epoch whole, and again stopped at a look and resumed from the
    position the stop reports. Same parameters, same epoch loss."""
    monkeypatch.setattr(train_eval_utils, "CHECK_EVERY", 2)
    monkeypatch.setattr(train_eval_utils, "LOOK_SECONDS", 1e9)  # steps never count as slow here
    args, batches = some_batches()
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    ctx = DistContext.single()

    whole, optimizer, scaler = fresh(args)
    expected = train_one_epoch(whole, criterion, optimizer, scaler, batches, 1, Progress(), None, args, ctx)
    assert expected.stopped == 0 and expected.batches == 5
    stopped, optimizer, scaler = fresh(args)
    looks = iter(range(10**6))
    result = train_one_epoch(stopped, criterion, optimizer, scaler, batches, 1, Progress(), None, args, ctx,
                             stop_requested=lambda: next(looks) >= 2)
    # The third look, after step 4 (the first is after step 1, then every 2).
    assert result.stopped == result.batches == 4 and result.sums[2] == 8
    position = Progress(steps_in_epoch=4, epoch_sums=result.sums)
    result = train_one_epoch(stopped, criterion, optimizer, scaler, batches[4:], 1, position, None, args, ctx)
    assert result.train_loss == pytest.approx(expected.train_loss, rel=1e-12)
    assert result.train_acc == expected.train_acc and result.train_images == 2 and result.epoch_images == 10
    for a, b in zip(whole.state_dict().values(), stopped.state_dict().values()):
        assert torch.equal(a, b)


def test_slow_steps_are_looked_at_more_often():
    """A SIGTERM waits for the next look: with steps of 2 s, a look every 2 steps (LOOK_SECONDS,
    5 s), not every 20; fast steps keep every 20th."""
    def looks(seconds_per_step: float) -> list[int]:
        found, look_at = [], 0
        for step in range(100):
            if step >= look_at:
                found.append(step)
                look_at = next_look(step, seconds_per_step)
        return found

    assert looks(2.0)[:4] == [0, 1, 3, 5]
    assert looks(0.01) == [0, 19, 39, 59, 79, 99]


def test_a_training_pass_looks_after_its_first_step_every_20_and_at_its_last():
    """The looks train_one_epoch makes (each asks whether a SIGTERM came), on fast steps: after
    the first step, then every 20 steps, and after the last."""
    model = torch.nn.Linear(4, 2)
    args = get_args_parser("test").parse_args(["--data-path", str(SAMPLE), "--amp", "off", "--no-channels-last"])
    optimizer, scaler = build_optimizer(model, args, None)
    batches = [(torch.randn(2, 4), torch.tensor([0, 1])) for _ in range(50)]
    asked = []
    result = train_one_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, scaler, batches, 1, Progress(), None, args,
                             DistContext.single(), stop_requested=lambda: asked.append(len(asked)) or False)
    assert result.stopped == 0 and len(asked) == 4  # after steps 1, 20, 40 and 50


def test_a_sigterm_that_came_between_epochs_stops_the_next_after_its_first_step():
    """A SIGTERM that arrived while rank 0 wrote the epoch's files is acted on after the next
    epoch's first step, not 20 steps into it: schedulers kill 30 s or so later."""
    args, batches = some_batches()
    model, optimizer, scaler = fresh(args)
    result = train_one_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, scaler, batches, 2, Progress(epoch=1), None,
                             args, DistContext.single(), stop_requested=lambda: True)
    assert result.stopped == 1


def test_an_evaluation_looks_after_its_first_batch():
    """evaluate() looks too: a SIGTERM that came at the end of training stops the evaluation
    after its first batch, with nothing to report; without one it counts every image."""
    args, batches = some_batches()
    model, _, _ = fresh(args)
    loader = torch.utils.data.DataLoader([(x, y) for b in batches for x, y in zip(*b)], batch_size=2)
    evaluation = evaluate_with(model, loader, args, lambda: True)
    assert evaluation.stopped and evaluation.val == {}
    evaluation = evaluate_with(model, loader, args, lambda: False)
    assert not evaluation.stopped and evaluation.val["val_total"] == 10


def evaluate_with(model, loader, args, stop_requested) -> Evaluation:
    return train_eval_utils.evaluate(model, loader, args, DistContext.single(), Extras(), stop_requested)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run a stopped-and-resumed run of `world_size` processes must reproduce, started once:
    its metrics and its final weights."""
    runs = {}

    def run(world_size: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
        if world_size not in runs:
            root = tmp_path_factory.mktemp(f"uninterrupted-{world_size}")
            ok(train("single" if world_size == 1 else "spawn", root, *steps_of(world_size), nproc=world_size,
                     timeout=300, fast=FAST_DEFAULT_WORKERS))
            runs[world_size] = metrics(root), load_checkpoint(root / "last.pth")["model"]
        return runs[world_size]

    return run


def ends_as_uninterrupted(out, expected: list[dict], weights: dict[str, torch.Tensor], ema: bool = False) -> None:
    """The resumed run's epochs and final weights are the uninterrupted run's: the same losses,
    accuracies and learning rates in each epoch (before the stop because the seed repeats a run,
    after it because resuming is exact), each epoch logged once."""
    resumed = metrics(out)
    assert [r["epoch"] for r in resumed] == [r["epoch"] for r in expected] == [1, 2]
    keys = ("train_loss", "train_acc", "train_seen", "val_loss", "val_acc", "lr")
    for a, b in zip(expected, resumed):
        for key in keys + (("ema_val_loss", "ema_val_acc") if ema else ()):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (b["epoch"], key)
    final = load_checkpoint(out / "last.pth")["model"]
    for name, value in weights.items():
        torch.testing.assert_close(final[name], value, msg=lambda m, name=name: f"{name}: {m}")


def preempted(out, world_size: int, err: str) -> dict:
    """What a stop leaves: every process said where it stopped, the same step; last.pth holds that
    position and preempted.txt says it. The checkpoint."""
    stops = STOPPED.findall(err)
    assert len(stops) == world_size and len(set(stops)) == 1, err[-3000:]
    step, epoch = map(int, stops[0])
    checkpoint = load_checkpoint(out / "last.pth")
    assert (checkpoint["epoch"], checkpoint["steps_in_epoch"]) == (epoch - 1, step), err[-3000:]
    logged = len(metrics(out)) if (out / "metrics.jsonl").exists() else 0
    assert checkpoint["epoch"] == logged, (checkpoint["epoch"], logged)  # metrics.jsonl names the epochs done
    assert checkpoint["epoch_seconds"] > 0  # the stopped epoch's training so far, which --time-budget counts
    assert (out / "preempted.txt").read_text().startswith(f"SIGTERM: every process stopped after step {step} of "
                                                          f"epoch {epoch}")
    return checkpoint


def torchrun_job_script(torchrun: str, output_dir: Path) -> str:
    """The job script of docs/troubleshooting.md, its torchrun command line replaced by `torchrun`,
    its run folder by `output_dir`."""
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    script = next(block for block in re.findall(r"```bash\n(.*?)```", text, re.S) if "trap '" in block and "torchrun" in block)
    command = re.search(r"^torchrun .*?&$", script, re.S | re.M).group(0)
    folder = re.search(r"--output-dir (\S+)", command).group(1)
    return script.replace(command, torchrun + " &").replace(folder, str(output_dir))


@pytest.mark.slow
# With the default loader workers, which get the SIGTERM too and ignore it: forked by the training
# process (single), or from multiprocessing's fork server on CPython before 3.11.10 (launch). The
# spawn launcher's case, the signal to the launcher alone, is a test below; SLURM's,
# tests/test_slurm.py's. The one-process case runs on the oldest torch too (.ci/run): resuming
# rests on torch's states.
@pytest.mark.parametrize("launcher", [pytest.param("single", marks=pytest.mark.floor), "launch"])
def test_sigterm_stops_at_a_step_and_resume_ends_as_if_uninterrupted(launcher, uninterrupted, tmp_path):
    """SIGTERM once epoch 1 is logged, as rank 0 writes its checkpoint or early in epoch 2: every
    process stops after the same step, the job exits 75, and resumed, the run ends as the
    uninterrupted one."""
    world_size = 1 if launcher == "single" else 2
    cmd = launcher_cmd(launcher, world_size) + ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path),
                                                 *FAST_DEFAULT_WORKERS, *steps_of(world_size)]
    if launcher == "launch":  # torchrun under the job script of docs/troubleshooting.md, which tells a preemption
        cmd = ["bash", "-c", torchrun_job_script(" ".join(cmd), tmp_path)]
    proc = start(cmd)
    try:
        deadline = time.monotonic() + 300
        while not ((tmp_path / "metrics.jsonl").exists() and metrics(tmp_path)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        if launcher == "launch":
            proc.send_signal(signal.SIGTERM)  # the script alone, as `docker stop` and Kubernetes signal it
        else:
            os.killpg(proc.pid, signal.SIGTERM)  # as slurmstepd signals every process of a job
        code, err = stopped_job(proc)
    finally:
        kill_group(proc)
    assert code == EXIT_PREEMPTED, err[-3000:]
    checkpoint = preempted(tmp_path, world_size, err)
    assert checkpoint["epoch"] == 1 and checkpoint["steps_in_epoch"] > 0

    out = ok(train(launcher, tmp_path, *steps_of(world_size), "--resume", "auto", nproc=world_size, timeout=300,
                   fast=FAST_DEFAULT_WORKERS)).stdout
    assert f"goes on after step {checkpoint['steps_in_epoch']}" in out
    ends_as_uninterrupted(tmp_path, *uninterrupted(world_size), ema=world_size == 1)


@pytest.mark.slow
def test_sigterm_to_the_spawn_launcher_as_rank_0_writes_the_epochs_files(uninterrupted, tmp_path):
    """SIGTERM to the spawn launcher alone, as soon as epoch 1 is announced: rank 0 is writing
    that epoch's metrics.jsonl line and checkpoint, inline. The launcher passes the signal on to
    its processes; rank 0 finishes its writes (the handler only notes the request), every rank
    stops after the first step of epoch 2, and the resumed run ends as the uninterrupted one."""
    proc = start(launcher_cmd("spawn", 2) + ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path),
                                             *FAST_DEFAULT_WORKERS, *steps_of(2)])
    try:
        for line in proc.stdout:
            if line.startswith("epoch 1/2:"):
                proc.send_signal(signal.SIGTERM)
                break
        code, err = stopped_job(proc)
    finally:
        kill_group(proc)
    assert code == EXIT_PREEMPTED, err[-3000:]
    checkpoint = preempted(tmp_path, 2, err)
    assert checkpoint["epoch"] == 1 and checkpoint["steps_in_epoch"] >= 1  # epoch 1's files whole

    ok(train("spawn", tmp_path, *steps_of(2), "--resume", "auto", nproc=2, timeout=300, fast=FAST_DEFAULT_WORKERS))
    ends_as_uninterrupted(tmp_path, *uninterrupted(2))


def evaluation_line() -> str:
    """`path:line` of evaluate()'s first statement: where an evaluation starts."""
    path = REPO / "multi_train_utils" / "train_eval_utils.py"
    evaluate = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "evaluate")
    first = next(statement for statement in evaluate.body  # after the docstring
                 if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)))
    return f"{path}:{first.lineno}"


@pytest.mark.slow
def test_sigterm_during_an_evaluation_stops_it_and_the_resumed_run_evaluates_again(uninterrupted, tmp_path):
    """SIGTERM to every process of a spawn job as epoch 1's evaluation starts (sent by each rank
    as it reaches evaluate(): tests/breakpoints/): every rank stops the evaluation at its
    first look, rank 0 saves the position "every batch of epoch 1 trained" and writes no line of
    metrics.jsonl; the resumed run trains no step of epoch 1 again, evaluates it, and ends as the
    uninterrupted run."""
    hook = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "breakpoints"),
                                                        os.environ.get("PYTHONPATH")])),
            "SIGTERM_AT": evaluation_line()}
    result = train("spawn", tmp_path, *steps_of(2), nproc=2, timeout=300, env=hook, fast=FAST_DEFAULT_WORKERS)
    assert result.returncode == EXIT_PREEMPTED, result.stderr[-3000:]
    assert "epoch 1/2:" not in result.stdout  # the evaluation never finished
    batches = int(re.search(r"(\d+) batches a process", result.stdout)[1])
    checkpoint = preempted(tmp_path, 2, result.stderr)
    assert (checkpoint["epoch"], checkpoint["steps_in_epoch"]) == (0, batches)
    assert not (tmp_path / "metrics.jsonl").exists() or not metrics(tmp_path)

    out = ok(train("spawn", tmp_path, *steps_of(2), "--resume", "auto", nproc=2, timeout=300,
                   fast=FAST_DEFAULT_WORKERS)).stdout
    assert f"epoch 1 goes on after step {batches}" in out
    ends_as_uninterrupted(tmp_path, *uninterrupted(2))


@pytest.mark.parametrize("launcher", ["single", "launch", "spawn"])
def test_a_sigterm_while_the_launcher_still_loads_torch_ends_it_at_once(launcher):
    """A job preempted as it starts: the SIGTERM comes while the launcher still imports torch,
    before main() runs. Nothing is saved before training, so nothing catches it: the process ends
    by the signal (exit status -15, 143 in a shell), at once, with no traceback. With --help, a
    launcher that got through its imports would print its help and exit 0."""
    script = {"single": "train_single_gpu.py", "launch": "train_multi_gpu_using_launch.py",
              "spawn": "train_multi_gpu_using_spawn.py"}[launcher]
    proc = start([sys.executable, script, "--help"])
    try:
        deadline = time.monotonic() + 30
        while "libtorch" not in open(f"/proc/{proc.pid}/maps").read():  # torch's libraries loading: mid-import
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        kill_group(proc)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, out[-500:], err[-2000:])
    assert "usage:" not in out and "Traceback" not in err, err[-2000:]
