"""What each process of a job takes for itself before it trains: its share of the CPUs (the
affinity taskset, a cpuset or srun gave it, shared among the processes of its machine), its math
threads (OMP_NUM_THREADS honoured), the job's one precision, and, for --eval-only, the image size
its checkpoint was trained at."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO, free_port, metrics, ok, train, train_here

from multi_train_utils import distributed_utils
from multi_train_utils.distributed_utils import (
    DistContext,
    Ranks,
    cpus_per_process,
    job_precision,
    process_context,
)
from my_dataset import default_workers


@pytest.fixture
def one_core():
    """This process narrowed to one of its cores, as taskset or a container's cpuset narrows it;
    its affinity and math threads given back afterwards."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {min(cores)})
    yield
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def test_a_narrowed_affinity_is_shared_among_the_machines_processes(one_core, monkeypatch):
    """On one core (of however many the machine has), one process takes that core, and so does
    each of four: never more CPUs than the affinity gives. Its threads follow, where
    OMP_NUM_THREADS does not say; its loader workers keep one core for the training process."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert cpus_per_process(Ranks(0, 0, 1, 1)) == 1
    assert cpus_per_process(Ranks(3, 3, 4, 4)) == 1
    torch.set_num_threads(4)
    ctx = process_context(None, "cpu")
    assert ctx.cpus == 1 and torch.get_num_threads() == 1
    assert default_workers(ctx.device, ctx.cpus) == 1  # at least one: decoding off the training process


@pytest.mark.parametrize("cores, local, expected", [(32, 4, 8), (32, 1, 32), (6, 4, 1), (3, 2, 1)])
def test_the_cpus_of_a_machine_are_shared_among_its_processes(monkeypatch, cores, local, expected):
    """`srun --ntasks-per-node=1 torchrun --nproc_per_node=4` on 32 CPUs: 8 each, not 32 each."""
    monkeypatch.setattr(distributed_utils, "cpu_count", lambda: cores)  # what the affinity holds
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "32")  # srun's task, which torchrun's processes share
    assert cpus_per_process(Ranks(0, 0, local, local)) == expected
    assert cpus_per_process(Ranks(0, 0, local, local, srun_task=True)) == min(cores, 32)  # srun's own task


def test_omp_num_threads_is_honoured(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for several processes a node; a user may set another.
    torch read it at import: the process keeps it."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        process_context(None, "cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


PROBE = """
import json, torch
from multi_train_utils.distributed_utils import env_ranks, process_context
from my_dataset import default_workers
ctx = process_context(env_ranks(), "cpu")
print(json.dumps({"cpus": ctx.cpus, "threads": torch.get_num_threads(), "workers": default_workers(ctx.device, ctx.cpus)}))
"""


@pytest.mark.slow
def test_torchruns_processes_on_a_narrowed_machine(tmp_path):
    """Two processes of torchrun on one core (taskset): one CPU each, torchrun's one thread, one
    loader worker each; before, each took every CPU the affinity held."""
    core = min(os.sched_getaffinity(0))
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK")}
    result = subprocess.run(["taskset", "-c", str(core), sys.executable, "-m", "torch.distributed.run",
                             "--nproc_per_node=2", "--standalone", str(probe)],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**env, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert seen == [{"cpus": 1, "threads": 1, "workers": 1}] * 2


def _precision_of_rank(rank: int, dtypes: list, port: int, results) -> None:
    """One rank of a gloo job whose ranks' hardware runs `dtypes[rank]` natively."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=len(dtypes))
    distributed_utils.autocast_dtype = lambda choice, device: dtypes[rank]  # this rank's GPU
    ctx = DistContext(rank, rank, len(dtypes), len(dtypes), torch.device("cpu"), distributed=True)
    results[rank] = job_precision("auto", ctx)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("dtypes, expected", [
    ([torch.bfloat16, torch.float16, torch.bfloat16], torch.float16),  # one older GPU: fp16 for all
    ([torch.bfloat16, None], None),  # one rank without a fast half precision: fp32 for all
])
def test_a_job_of_mixed_hardware_trains_in_one_precision(dtypes, expected):
    """--amp auto on GPUs of different kinds: every rank takes the precision every rank runs
    natively. Ranks in different precisions take different steps (fp16's loss scaler skips some)
    and their copies of the model part without a word."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_precision_of_rank, args=(dtypes, free_port(), results), nprocs=len(dtypes))
        assert [results[r] for r in range(len(dtypes))] == [expected] * len(dtypes)


@pytest.mark.slow
def test_eval_only_evaluates_at_the_checkpoints_size(tmp_path):
    """A run trained at 32 px, evaluated with --eval-only --resume and no --img-size (224 by
    default): at 32 px, said in a line, with the loss the run itself reported for that epoch."""
    run = tmp_path / "run"
    ok(train_here(run, "--epochs", "1", "--model", "resnet18", "--no-channels-last"))
    evaluated = tmp_path / "eval"
    out = ok(train("single", evaluated, "--eval-only", "--resume", str(run / "last.pth"), "--model", "resnet18",
                   "--no-channels-last", fast=["--batch-size", "8", "--workers", "0"])).stdout
    assert "was trained with --img-size 32: evaluating at that size" in out
    result = json.loads((evaluated / "eval.json").read_text())
    assert result["val_correct"] == metrics(run)[0]["val_correct"]
    assert result["val_loss"] == pytest.approx(metrics(run)[0]["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_an_epoch_that_waited_for_a_busy_core_says_so(one_core, tmp_path):
    """The run alone on its core: its epoch line says nothing of the CPU. With two other programs
    spinning on that core, its training thread waits for it most of the epoch (Linux's count, not
    a clock): the line gives the share."""
    ok(train_here(tmp_path / "alone", "--epochs", "1", "--model", "resnet18", "--no-channels-last"))
    alone = metrics(tmp_path / "alone")[0]
    assert alone["cpu_queued_seconds"] < 0.25 * alone["epoch_seconds"], alone
    core = os.sched_getaffinity(0)
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin, preexec_fn=lambda: os.sched_setaffinity(0, core)) for _ in range(2)]
    try:
        out = ok(train_here(tmp_path / "busy", "--epochs", "1", "--model", "resnet18", "--no-channels-last")).stdout
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    busy = metrics(tmp_path / "busy")[0]
    share = busy["cpu_queued_seconds"] / busy["epoch_seconds"]
    assert share > 0.4, busy  # a third of the core is the run's
    assert f"% waiting for data, {share:.0%} for a free core)" in out
