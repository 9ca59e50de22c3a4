"""Preemption: SIGTERM (what SLURM sends ahead of a time limit or a preemption, and Kubernetes
on eviction) stops every rank at the same step; rank 0 saves the position inside the epoch; the
job exits 75; `--resume auto` goes on from that step and ends as if nothing had happened."""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, FAST, FAST_DEFAULT_WORKERS, SAMPLE, SMALL_MODEL, kill_group, launcher_cmd, metrics, ok, start, train, wait_for_epochs

from model import create_model
from multi_train_utils import train_eval_utils
from multi_train_utils.checkpoint import load_checkpoint, make_checkpoint
from multi_train_utils.config import get_args_parser
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.progress import Progress, progress_of
from multi_train_utils.train_eval_utils import build_optimizer, place_model, train_one_epoch
from my_dataset import EpochKeys, MyDataSet, build_transform
from utils import Preempted, list_images

EXIT_PREEMPTED = Preempted.exit_code
# Batch 2: an epoch of the sample is 47 steps in one process and 23 in each of two, so that
# the loop's checks (every 20 steps) fall inside epochs, where a stop is hardest to resume.
SMALL_STEPS = ["--epochs", "2", "--batch-size", "2", *SMALL_MODEL]
# The one-process run adds every option of the recipe that has state or randomness of its own:
# a stop inside an epoch must keep each one's place too (the weight average, the mixing and
# augmentation draws, the accumulated half step, the ramp of image sizes).
RECIPE = ["--ema", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--auto-augment", "ta_wide",
          "--random-erase", "0.25", "--img-size", "48", "--min-img-size", "32", "--ramp-epochs", "2",
          "--clip-grad-norm", "2", "--accum-steps", "2", "--val-img-size", "56", "--tta"]


def steps_of(world_size: int) -> list[str]:
    return SMALL_STEPS + (RECIPE if world_size == 1 else [])


# The handler in a process of its own: before training it ends the process on the spot.
HANDLER = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from cluster.sigterm import Preemption
during = Preemption()
signal.signal(signal.SIGTERM, during.on_sigterm)
during.training = True
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.1)
print("during training: requested", during.requested(), flush=True)
signal.signal(signal.SIGTERM, Preemption().on_sigterm)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
finally:
    print("unwound", flush=True)
"""


def test_sigterm_is_an_exit_before_training_and_a_flag_during_it():
    """During training a SIGTERM is a request, looked at by the loop; before it, an exit with 75
    where the signal lands, with no exception to unwind the code it interrupted (an import of
    torch cut short by one fails with exit 1, or leaves importlib's locks held for ever)."""
    result = subprocess.run([sys.executable, "-c", HANDLER, str(REPO)], capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_PREEMPTED, result.stderr
    assert result.stdout == "during training: requested True\n", result.stdout
    assert result.stderr.startswith("stopped: SIGTERM before training: this process ends here with 75")

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
    progress = Progress(2, 0.5, 7, (1.0, 2.0, 3.0), seconds_used=30.0, slowest_train=9.0)
    progress.finish_epoch(3, 0.6, {"seconds": 8.0, "epoch_images": 10, "train_images": 10}, 2.0)
    assert (progress.epoch, progress.steps_in_epoch, progress.epoch_sums, progress.best_acc) == (3, 0, (0, 0, 0), 0.6)
    assert (progress.seconds_used, progress.slowest_train, progress.first_epoch) == (40.0, 9.0, None)
    # Stopped inside epoch 1 after 5.5 s of training, at its last step, and resumed: --time-budget's
    # count takes epoch 1's time before and after the stop, as its checkpoint carries it.
    model = torch.nn.Linear(2, 2)
    stopped = Progress(0, -1.0, 11, (1.0, 2.0, 95.0), epoch_seconds=5.5)
    resumed = progress_of(make_checkpoint(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          torch.amp.GradScaler("cpu", enabled=False), stopped, argparse.Namespace(),
                                          ["a", "b"], world_size=1))
    resumed.finish_epoch(1, 0.4, {"seconds": 0.01, "epoch_images": 95, "train_images": 0}, 1.0)
    assert resumed.first_epoch == (5.51, 1.0) and resumed.seconds_used == 6.51 and resumed.epoch_seconds == 0.0


def some_batches() -> tuple[argparse.Namespace, list[tuple[torch.Tensor, torch.Tensor]]]:
    args = get_args_parser("test").parse_args(["--data-path", str(SAMPLE), "--epochs", "1", "--amp", "off"])
    _, samples = list_images(str(SAMPLE))
    dataset = MyDataSet(samples[::12], build_transform(32, train=True), 32, seed=0)
    batches = [[dataset[(1, i)] for i in range(j, j + 2)] for j in range(0, 10, 2)]
    return args, [(torch.stack([x for x, _ in b]), torch.tensor([y for _, y in b])) for b in batches]


@pytest.mark.slow
def test_stopping_inside_an_epoch_and_going_on_equals_the_whole_epoch(monkeypatch):
    """In one process: train an epoch whole, and again stopped at a check and resumed from the
    position the stop reports. Same parameters, same epoch loss."""
    monkeypatch.setattr(train_eval_utils, "CHECK_EVERY", 2)
    monkeypatch.setattr(train_eval_utils, "LOOK_SECONDS", 1e9)  # steps never count as slow here
    args, batches = some_batches()
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
        torch.manual_seed(0)
        model = create_model(5)
        place_model(model, args, torch.device("cpu"))
        return model, *build_optimizer(model, args, torch.device("cpu"))[:2]

    whole, optimizer, scaler = fresh()
    expected = train_one_epoch(whole, criterion, optimizer, scaler, batches, 1, Progress(), args, DistContext.single())
    assert expected["stopped_after"] is None
    stopped, optimizer, scaler = fresh()
    checks = iter(range(10**6))
    result = train_one_epoch(stopped, criterion, optimizer, scaler, batches, 1, Progress(), args, DistContext.single(),
                             stop_requested=lambda: next(checks) >= 2)
    # The third check, after step 4 (the first is after step 1, then every 2).
    assert result["stopped_after"] == 4 and result["sums"][2] == 8
    position = Progress(steps_in_epoch=4, epoch_sums=result["sums"])
    result = train_one_epoch(stopped, criterion, optimizer, scaler, batches[4:], 1, position, args,
                             DistContext.single())
    assert result["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-12)
    assert result["train_acc"] == expected["train_acc"] and result["train_images"] == 2
    for a, b in zip(whole.state_dict().values(), stopped.state_dict().values()):
        assert torch.equal(a, b)


def test_slow_steps_are_looked_at_more_often():
    """A SIGTERM waits for the next look: with steps of 2 s, a look every 2 steps (LOOK_SECONDS,
    5 s), not every 20; fast steps keep every 20th; the interval follows the slowest rank."""
    steps = train_eval_utils.Accumulation(1, 100)
    looks = [step for step in range(100) if steps.place(step).look and (steps.looked(step, 2.0) or True)]
    assert looks[:4] == [0, 1, 3, 5] and looks[-1] == 99
    steps = train_eval_utils.Accumulation(1, 100)
    looks = [step for step in range(100) if steps.place(step).look and (steps.looked(step, 0.01) or True)]
    assert looks == [0, 19, 39, 59, 79, 99]


def test_a_sigterm_that_came_between_epochs_stops_the_next_after_its_first_step():
    """A SIGTERM that arrived while the model evaluated or rank 0 saved is acted on after the
    next epoch's first step, not CHECK_EVERY (20) steps into it: schedulers kill 30 s or so later."""
    args, batches = some_batches()
    model = create_model(5)
    place_model(model, args, torch.device("cpu"))
    optimizer, scaler, _ = build_optimizer(model, args, torch.device("cpu"))
    result = train_one_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, scaler, batches, 2, Progress(epoch=1), args,
                             DistContext.single(), stop_requested=lambda: True)
    assert result["stopped_after"] == 1


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


def torchrun_job_script(torchrun: str) -> str:
    """The job script of docs/troubleshooting.md, its torchrun command line replaced by `torchrun`."""
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    script = re.search(r"```bash\n(trap 'preempted=1.*?)```", text, re.S).group(1)
    command = re.search(r"^torchrun .*?&$", script, re.S | re.M).group(0)
    return script.replace(command, torchrun + " &")


@pytest.mark.slow
# With the default loader workers, which get the SIGTERM too: forked by the training process
# (single), or by a fork server on CPython before 3.11.10 (launch). The spawn launcher's case,
# the signal to the launcher alone, is the next test's; SLURM's, tests/test_slurm.py's. The
# one-process case runs on the oldest torch too (.ci/run): resuming rests on torch's states.
@pytest.mark.parametrize("launcher", [pytest.param("single", marks=pytest.mark.floor), "launch"])
def test_sigterm_stops_at_a_step_and_resume_ends_as_if_uninterrupted(launcher, uninterrupted, tmp_path):
    """Stopped inside epoch 1 and resumed, the run ends as the uninterrupted one: the same
    losses, accuracies and learning rates in each epoch (before the stop because the seed
    repeats a run, after it because resuming is exact), and the same final weights."""
    world_size = 1 if launcher == "single" else 2
    cmd = launcher_cmd(launcher, world_size) + ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path),
                                                 *FAST_DEFAULT_WORKERS, *steps_of(world_size)]
    if launcher == "launch":  # torchrun under the job script of docs/troubleshooting.md, which tells a preemption
        cmd = ["bash", "-c", torchrun_job_script(" ".join(cmd))]
    proc = start(cmd)
    try:
        wait_for_epochs(proc, tmp_path, 1, timeout=300)
        if launcher == "launch":
            proc.send_signal(signal.SIGTERM)  # the script alone, as `docker stop` and Kubernetes signal it
        else:
            os.killpg(proc.pid, signal.SIGTERM)  # as slurmstepd signals every process of a job
        code, err = proc.wait(timeout=120), proc.stderr.read()
    finally:
        kill_group(proc)
    assert err.count("stopped: SIGTERM: every process stopped after step") == world_size, err[-3000:]
    assert code == EXIT_PREEMPTED, err[-3000:]
    checkpoint = load_checkpoint(tmp_path / "last.pth")
    assert checkpoint["steps_in_epoch"] > 0 and checkpoint["epoch"] == len(metrics(tmp_path)), checkpoint["epoch"]
    assert checkpoint["epoch_seconds"] > 0  # the stopped epoch's training so far, which --time-budget counts

    out = ok(train(launcher, tmp_path, *steps_of(world_size), "--resume", "auto", nproc=world_size, timeout=300,
                   fast=FAST_DEFAULT_WORKERS)).stdout
    assert f"goes on after step {checkpoint['steps_in_epoch']}" in out
    resumed = metrics(tmp_path)
    assert [r["epoch"] for r in resumed] == [1, 2]
    expected, weights = uninterrupted(world_size)
    keys = ("train_loss", "train_acc", "train_seen", "val_loss", "val_acc", "lr")
    for a, b in zip(expected, resumed):
        for key in keys + (("ema_val_loss", "ema_val_acc") if world_size == 1 else ()):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (b["epoch"], key)
    final = load_checkpoint(tmp_path / "last.pth")["model"]
    for name, value in weights.items():
        torch.testing.assert_close(final[name], value, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_sigterm_while_epoch_files_are_written_and_batches_load_ahead(uninterrupted, tmp_path):
    """SIGTERM to the spawn launcher alone, as soon as epoch 1 is announced: the launcher passes
    it on to its processes; epoch 1's checkpoint is then still being written in the background,
    and epoch 2's batches are loading in the loader workers (here one per process, where the
    uninterrupted run loaded in the training processes). The stop waits for that write, then
    saves its own position; the resumed run, loading ahead again, ends as the uninterrupted one
    did."""
    ahead = ["--workers", "1"]
    proc = start(launcher_cmd("spawn", 2) + ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path), *FAST,
                                             *SMALL_STEPS, *ahead])
    try:
        for line in proc.stdout:
            if line.startswith("epoch 1/2:"):
                proc.send_signal(signal.SIGTERM)
                break
        code, err = proc.wait(timeout=120), proc.stderr.read()
    finally:
        kill_group(proc)
    assert code == EXIT_PREEMPTED, err[-3000:]
    checkpoint = load_checkpoint(tmp_path / "last.pth")
    assert checkpoint["epoch"] == 1 and checkpoint["steps_in_epoch"] > 0 and len(metrics(tmp_path)) == 1

    ok(train("spawn", tmp_path, *SMALL_STEPS, *ahead, "--resume", "auto", nproc=2, timeout=300))
    expected, weights = uninterrupted(2)
    for a, b in zip(expected, metrics(tmp_path), strict=True):
        for key in ("train_loss", "train_acc", "train_seen", "val_loss", "val_acc", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (b["epoch"], key)
    final = load_checkpoint(tmp_path / "last.pth")["model"]
    for name, value in weights.items():
        torch.testing.assert_close(final[name], value, msg=lambda m, name=name: f"{name}: {m}")


def sigterm_caught(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (the caught-signals mask in /proc)."""
    fields = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
    return bool(int(fields["SigCgt"], 16) & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("launcher", ["single", "launch", "spawn"])
def test_a_sigterm_while_the_launcher_still_loads_torch_ends_it_with_75(launcher):
    """A job preempted as it starts: the SIGTERM comes while the launcher still imports torch
    (seconds), before main() runs. The process ends with 75, for the scheduler to requeue it,
    not 143 (killed by the signal). With --help, a launcher that got through its imports would
    print its help and exit 0."""
    script = {"single": "train_single_gpu.py", "launch": "train_multi_gpu_using_launch.py",
              "spawn": "train_multi_gpu_using_spawn.py"}[launcher]
    proc = start([sys.executable, script, "--help"])
    try:
        deadline = time.monotonic() + 10
        while not sigterm_caught(proc.pid):  # the launcher's first statement after `import signal`
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.002)
        # Caught before torch's libraries are loaded: the launcher, not its main(), caught it.
        assert "libtorch" not in open(f"/proc/{proc.pid}/maps").read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, out[-500:], err[-2000:])
    assert "usage:" not in out and "Traceback" not in err, err[-2000:]
