"""Real process groups on CPU (gloo): torchrun and mp.spawn subprocesses, and DDP exactness."""
from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO, SAMPLE, args_for, free_port, metrics, ok, sample_batch, train, train_here
from test_launcher_page import LAUNCHER, NINE_STEPS, START, functions, names_used
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from model import cpu_sync_batchnorm, create_model
from multi_train_utils import distributed_utils
from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.config import list_images_of
from multi_train_utils.distributed_utils import DistContext, Ranks, ShardSampler, process_context
from multi_train_utils.train_eval_utils import Progress, build_optimizer, train_one_epoch
from my_dataset import EpochKeys, MyDataSet, build_transform, default_workers, normalize, train_and_val_sets
from outputs import scaling
from outputs.scaling import ddp_timers
from utils import TrainingDiverged, list_images, load_split, split_samples

METRIC_KEYS = {"epoch", "train_loss", "train_total", "val_loss", "val_acc", "val_correct", "val_total", "lr",
               "epoch_seconds", "train_images_per_sec", "world_size", "global_batch_size", "data_wait_seconds"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One short training run per launcher, shared by the tests below."""
    root = tmp_path_factory.mktemp("runs")
    results = {}
    # The single launcher's process is not under test here (the original command lines' test
    # starts it, among others): its main() runs in this process.
    results["single"] = (root / "single", ok(train_here(root / "single", "--epochs", "2", "--scaling")))
    # The torchrun run with a breakpoint on each line of the eight steps (tests/breakpoints/).
    (root / "reached").mkdir()
    breakpoints = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "breakpoints"),
                                                               os.environ.get("PYTHONPATH")])),
                   "BREAKPOINTS": ";".join(f"{path}:{line}" for _, _, path, line in step_lines()),
                   "BREAKPOINTS_OUT": str(root / "reached")}
    results["launch"] = (root / "launch", ok(train("launch", root / "launch", "--epochs", "2", nproc=2, env=breakpoints)))
    # The end of run's options, off by default: the report of best.pth's weights and the scaling summary.
    results["spawn"] = (root / "spawn", ok(train("spawn", root / "spawn", "--epochs", "2", "--report", "--scaling",
                                                 nproc=3)))
    return results


def step_lines() -> list[tuple[str, str, Path, int]]:
    """Each line of the nine steps (tests/test_launcher_page.py's chains, from the torchrun
    launcher's call down to torch's): the step, the name called there, its file and line; a name
    called on more than one line (save_checkpoint's save_atomic: best.pth's, last.pth's) on each."""
    found = []
    for step, chain in NINE_STEPS.items():
        for file, function, name in chain:
            path = REPO / (LAUNCHER if file == "launcher" else file)
            node = functions(path)[START[LAUNCHER] if function == "start" else function]
            found += [(step, name, path, line) for line in sorted({n.lineno for n, used in names_used(path, node)
                                                                   if used == name})]
    return found


def reached_by_rank(folder: Path) -> dict[str, set[str]]:
    """The `path:line` breakpoints each rank reached, from the records tests/breakpoints/ wrote in `folder`
    (benchmarks/gpu_session.sh reads a GPU run's with it too)."""
    reached: dict[str, set[str]] = {}
    for written in folder.glob("*.json"):
        record = json.loads(written.read_text())
        reached.setdefault(record["rank"], set()).update(record["reached"])
    return reached


@pytest.mark.slow
def test_a_breakpoint_on_each_of_the_nine_steps_stops_a_default_run(runs):
    """The torchrun run above (2 processes, the defaults but the sizes): a debugger's breakpoint on
    each line of the nine steps, the launcher's and those below it, is reached, on every rank;
    rank 0 alone saves. All but SyncBN's: --sync-bn is off by default (tests/test_collective_trace.py's
    run with it records the all_reduce of its statistics in each forward)."""
    reached = reached_by_rank(runs["launch"][0].parent / "reached")
    assert {"0", "1"} <= reached.keys(), reached.keys()  # and torchrun's agent, of no rank
    by_call: dict[tuple[str, str, Path], set[str]] = {}
    for step, call, path, line in step_lines():  # a call on several lines: the run takes one of them
        by_call.setdefault((step, call, path), set()).update(
            rank for rank in ("0", "1") if f"{path}:{line}" in reached.get(rank, ()))
    for (step, call, path), ranks in by_call.items():
        expected = set() if step == "SyncBatchNorm" else {"0"} if step == "rank 0's save" else {"0", "1"}
        assert ranks == expected, (step, call, path.name, ranks)


@pytest.mark.slow
@pytest.mark.floor
@pytest.mark.parametrize("launcher, world_size", [("single", 1), ("launch", 2), ("spawn", 3)])
def test_end_to_end(runs, launcher, world_size):
    out, result = runs[launcher]
    records = metrics(out)
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        assert METRIC_KEYS <= r.keys()
        assert r["world_size"] == world_size and r["global_batch_size"] == 8 * world_size
        assert r["train_total"] == 95 and r["val_total"] == 25
        assert r["train_seen"] == SEEN[world_size]  # counted as the batches came, summed over the processes
        assert 0 <= r["val_acc"] <= 1 and r["val_correct"] == round(r["val_acc"] * 25)
        assert 0 < r["data_wait_seconds"] < r["epoch_seconds"]
    ckpt = load_checkpoint(out / "last.pth")
    assert {"model", "optimizer", "scaler", "epoch", "best_acc", "args", "class_names"} <= ckpt.keys()
    assert ckpt["epoch"] == 2
    assert not any(k.startswith("module.") for k in ckpt["model"])  # saved without the DDP wrapper
    assert ckpt["class_names"] == ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
    assert ckpt["args"]["epochs"] == 2
    assert (out / "best.pth").exists()
    assert json.loads((out / "class_indices.json").read_text())["0"] == "daisy"
    assert json.loads((out / "config.json").read_text())["world_size"] == world_size
    split = load_split(out / "split.json")
    assert (len(split.train), len(split.val)) == (95, 25) and split.class_names == ckpt["class_names"]
    assert list(out.glob("events.out.tfevents.*"))
    assert not list(out.glob("*.png"))  # --no-plots
    # Rank 0 alone prints: one summary line per epoch, not one per process.
    assert result.stdout.count("epoch 2/2: train loss") == 1
    if world_size > 1:
        # Math threads: torchrun sets OMP_NUM_THREADS=1 for 2 processes or more, which the process
        # keeps; mp.spawn sets nothing, and each process takes its share of the CPUs.
        threads = 1 if launcher == "launch" else max(1, len(os.sched_getaffinity(0)) // world_size)
        assert f"world_size={world_size}, threads per process={threads}" in result.stdout
    # The end-of-run report and the scaling summary are off by default (the torchrun run's).
    assert (out / "report.json").exists() == (launcher == "spawn")
    # A multi-process run with --scaling ends by saying what its processes bought, measured: the
    # images/s of its epochs, the loop's waits for data, DDP's own timers of the gradients'
    # all-reduce. One process (given --scaling too) has nothing to say.
    if launcher != "spawn":
        assert "scaling:" not in result.stdout and not (out / "scaling.json").exists()
        return
    scaling = json.loads((out / "scaling.json").read_text())
    seconds = sum(r["epoch_seconds"] for r in records)
    assert scaling["processes"] == world_size
    assert scaling["images_per_sec"] == pytest.approx(sum(r["train_images_per_sec"] * r["epoch_seconds"]
                                                          for r in records) / seconds, rel=1e-6)
    assert scaling["images_per_sec_per_process"] == pytest.approx(scaling["images_per_sec"] / world_size)
    assert scaling["data_wait_share"] == pytest.approx(sum(r["data_wait_seconds"] for r in records) / seconds, rel=1e-6)
    timers = scaling["ddp_timers_ms"]
    assert all(timers[key] > 0 for key in ("forward_ms", "backward_ms", "all_reduce_ms"))
    assert scaling["all_reduce_wait_ms"] == pytest.approx(max(0, timers["all_reduce_ms"] - timers["hidden_ms"]))
    assert 0 <= scaling["all_reduce_wait_share"] < 1
    # The forward and backward passes and the wait DDP timed fit inside the step the epochs measured.
    # (DDP's averages lean on the first steps, the slowest: a loose bound.)
    assert timers["forward_ms"] + timers["backward_ms"] + scaling["all_reduce_wait_ms"] < 2 * scaling["step_ms"]
    line = next(x for x in result.stdout.splitlines() if x.startswith("scaling:"))
    assert line.startswith(f"scaling: {world_size} processes trained {scaling['images_per_sec']:.1f} img/s in all")
    assert f"{scaling['all_reduce_wait_share']:.0%} for the gradients' all-reduce" in line


@pytest.mark.slow
def test_evaluation_and_report_are_exact_on_any_world_size(runs, tmp_path):
    """The spawn run's best checkpoint (3 processes), evaluated again by 1 and 2 processes over 25
    validation images (which neither 2 nor 3 divides), gives exactly what the run itself reported:
    the accuracy and loss of that epoch, and the whole evaluation report, which --report made at
    the run's end from best.pth's weights (an evaluation in 1 process, here in this one, makes
    its report as a 1-process run does)."""
    out, _ = runs["spawn"]
    best_epoch = load_checkpoint(out / "best.pth")["epoch"]
    reported = metrics(out)[best_epoch - 1]
    run_report = json.loads((out / "report.json").read_text())
    assert run_report["weights"] == f"{out / 'best.pth'} (epoch {best_epoch})" and run_report["world_size"] == 3
    for world_size, launcher in ((1, "single"), (2, "launch")):
        again = tmp_path / f"eval-{world_size}"
        argv = ("--eval-only", "--resume", str(out / "best.pth"), *(("--plots",) if world_size == 1 else ()))
        ok(train_here(again, *argv) if launcher == "single" else train(launcher, again, *argv, nproc=world_size))
        result = json.loads((again / "eval.json").read_text())
        assert result["val_total"] == 25
        assert result["val_correct"] == reported["val_correct"]
        assert result["val_loss"] == pytest.approx(reported["val_loss"], rel=1e-5)
        report = json.loads((again / "report.json").read_text())
        for key in ("images", "accuracy", "macro_f1", "per_class", "top_k_accuracy", "confusion_matrix"):
            assert report[key] == run_report[key], (world_size, key)
        assert report["world_size"] == world_size and report["images"] == 25
    assert (tmp_path / "eval-1" / "confusion_matrix.png").is_file()  # --plots draws the report's pictures


# Training images drawn in an epoch of the 95-image split, 8 per batch, by world size (docs/exactness.md).
SEEN = {1: 88, 2: 96, 3: 96}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_training_image_is_drawn_once_an_epoch_less_the_dropped_plus_the_padding(world_size):
    """The training loaders of all ranks together, built as the launchers build them: each image
    once an epoch, except that the DistributedSampler repeats the first images of its shuffle
    until every rank has as many, and a rank's last batch is dropped when shorter than
    --batch-size (while the shard is longer than one)."""
    args = args_for("--workers", "0", "--batch-size", "8")
    plan = list_images_of(args, "single", verbose=False)
    split = split_samples(plan.samples, plan.class_names, args.val_rate, args.seed, plan.val_files)
    train_set, _ = train_and_val_sets(split, args)
    n, per_rank = len(split.train), -(-len(split.train) // world_size)  # 95, and ceil(95 / world_size)
    padding, kept = world_size * per_rank - n, per_rank - per_rank % 8
    samplers = [DistributedSampler(train_set, num_replicas=world_size, rank=r, shuffle=True, seed=args.seed)
                for r in range(world_size)]
    loaders = [DataLoader(train_set, sampler=EpochKeys(sampler), batch_size=8, drop_last=len(sampler) > 8)
               for sampler in samplers]
    missed_by_epoch = []
    for epoch in (1, 2):
        drawn = []
        for loader, sampler in zip(loaders, samplers):
            sampler.set_epoch(epoch)
            drawn += [index for batch in loader.batch_sampler for e, index in batch if e == epoch]
        assert len(drawn) == world_size * kept == SEEN[world_size]
        counts = Counter(drawn)
        assert max(counts.values()) <= 2 and sum(c - 1 for c in counts.values()) <= padding
        missed = set(range(n)) - counts.keys()
        assert len(missed) <= world_size * (per_rank % 8)
        missed_by_epoch.append(missed)
    if world_size == 1:  # 7 dropped, a different 7 each epoch: no image is left out for good
        assert len(missed_by_epoch[0]) == 7 and missed_by_epoch[0] != missed_by_epoch[1]
    else:  # no batch dropped; one image twice, the padding
        assert missed_by_epoch == [set(), set()]


def test_shard_sampler_covers_each_index_once():
    for n in range(0, 12):
        for world in (1, 2, 3, 5):
            shards = [list(ShardSampler(n, DistContext(r, r, world, world, torch.device("cpu"), True)))
                      for r in range(world)]
            assert sorted(sum(shards, [])) == list(range(n))


@pytest.fixture
def threads_of(monkeypatch):
    """The math threads and CPUs (ctx.cpus, which sizes the loader workers) one process sets itself
    on a 32-core machine, with `ranks` (None: one process) in the environment `env`."""
    before = torch.get_num_threads()
    monkeypatch.setattr(distributed_utils, "cpu_count", lambda: 32)  # a 32-core machine, this process bound to none

    def threads(ranks: Ranks | None, env: dict[str, str]) -> tuple[int, int]:
        for key in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        torch.set_num_threads(7)  # a value none of the cases sets
        ctx = process_context(ranks, "cpu")
        return torch.get_num_threads(), ctx.cpus

    yield threads
    torch.set_num_threads(before)


def test_each_cpu_process_gets_its_share_of_the_cores(threads_of):
    """Threads: the process's share of the CPUs, unless OMP_NUM_THREADS says (torchrun sets 1 for 2
    processes or more, which is honoured); an srun task's CPUs are SLURM_CPUS_PER_TASK. The loader
    workers are the CPUs less one, 8 at most on the CPU, at least one."""
    assert threads_of(None, {}) == (32, 32)  # one process
    assert threads_of(Ranks(0, 0, 2, 2), {}) == (16, 16)  # mp.spawn exports nothing
    assert threads_of(Ranks(1, 1, 2, 2), {"OMP_NUM_THREADS": "1"}) == (7, 16)  # torchrun's, or the user's
    assert threads_of(Ranks(0, 0, 8, 4, srun_task=True), {"SLURM_CPUS_PER_TASK": "6"}) == (6, 6)
    assert threads_of(Ranks(0, 0, 8, 4), {"SLURM_CPUS_PER_TASK": "6"}) == (8, 8)  # not an srun task: its share
    assert [default_workers(torch.device("cpu"), cpus) for cpus in (1, 2, 6, 16)] == [1, 1, 5, 8]
    assert default_workers(torch.device("cuda"), 16) == 15


def _real_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    names, samples = list_images(str(SAMPLE))
    picked = samples[:: len(samples) // size][:size]
    ds = MyDataSet(picked, build_transform(32, train=False), 32)
    images, labels = zip(*(ds[i] for i in range(size)))
    return normalize(torch.stack(images)).double(), torch.tensor(labels)


def _step(model, ctx, images, labels, model_without_ddp=None):
    """One optimizer step of train_one_epoch, at a learning rate of 0.05: the peak of a global
    batch of 128 at --lr 0.1, reached at once (no warm-up), held (no decay)."""
    module = model_without_ddp or model
    args = args_for("--weight-decay", "1e-4", "--amp", "off", "--no-channels-last", "--warmup-epochs", "0", "--lrf", "1",
                    "--lr", str(0.1 * 128 / (len(labels) * ctx.world_size)), "--batch-size", str(len(labels)))
    optimizer, scaler = build_optimizer(module, args, None)
    train_one_epoch(model, torch.nn.CrossEntropyLoss(label_smoothing=0.1), optimizer, scaler, [(images, labels)], 1,
                    Progress(), None, args, ctx)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _ddp_worker(rank: int, port: int, out_dir: str, per_rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = process_context(Ranks(rank, rank, 2, 2), "cpu")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_default_dtype(torch.float64)
        images, labels = _real_batch(2 * per_rank)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        for sync in (True, False):
            torch.manual_seed(0)
            model = create_model(5)
            if sync:
                model = cpu_sync_batchnorm(model)
            state = _step(DDP(model), ctx, images[mine], labels[mine], model_without_ddp=model)
            if rank == 0:
                torch.save(state, os.path.join(out_dir, f"sync_{sync}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_with_sync_bn_takes_the_same_step_as_one_process(tmp_path):
    """Two ranks with batch b and SyncBN end one optimizer step with the parameters (and
    BatchNorm statistics) of one process with batch 2b; without SyncBN they do not.

    In float64, so the comparison sees the update rule and not rounding: in float32 the first
    step from random weights, with BatchNorm over 8 values per channel in the last stage,
    amplifies rounding to about 1e-4 in both runs alike (float64 agrees to 1e-13)."""
    per_rank = 4
    mp.spawn(_ddp_worker, args=(free_port(), str(tmp_path), per_rank), nprocs=2)
    images, labels = _real_batch(2 * per_rank)
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        single = _step(create_model(5), DistContext.single(), images, labels)
    finally:
        torch.set_default_dtype(torch.float32)
    synced = torch.load(tmp_path / "sync_True.pt")
    unsynced = torch.load(tmp_path / "sync_False.pt")
    worst = max((synced[k] - single[k]).abs().max().item() for k in single)
    assert worst < 1e-5, worst
    gap = max((unsynced[k] - single[k]).abs().max().item() for k in single)
    assert gap > 1e-3, "without SyncBN the step should differ; the comparison has no teeth"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_sync_batchnorm_matches_batchnorm_under_autocast(dtype):
    """One rank of a real gloo group: CPUSyncBatchNorm gives BatchNorm2d's output, gradient and
    running statistics, also when autocast feeds it bf16 activations (as --amp does on the CPU)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        x = torch.randn(6, 4, 5, 5) * 3 + 1
        plain, sync = torch.nn.BatchNorm2d(4), cpu_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(4)))[0]
        outputs = []
        for layer in (plain, sync):
            inp = x.to(dtype).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = layer(inp)
            out.float().pow(2).sum().backward()
            outputs.append((out.float(), inp.grad.float(), layer.running_mean, layer.running_var))
        tolerance = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
        assert out.dtype == dtype  # the sync layer hands back what it was given
        for a, b in zip(*outputs):
            torch.testing.assert_close(a, b, **tolerance)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("launcher, nproc", [("single", 1), ("launch", 2)])
def test_non_finite_loss_stops_every_rank(tmp_path, launcher, nproc):
    argv = ("--epochs", "2", "--lr", "1e20", "--warmup-epochs", "0")
    result = train_here(tmp_path, *argv) if launcher == "single" else train(launcher, tmp_path, *argv, nproc=nproc)
    assert result.returncode == TrainingDiverged.exit_code, result.stderr[-3000:]  # torchrun's own code is 1 too
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: the loss became NaN")]
    assert len(errors) == nproc and len(set(errors)) == 1, result.stderr[-3000:]  # every rank, at the same look
    batches = 11 if nproc == 1 else 6  # 95 images, batch 8, the shorter last batch dropped
    assert re.search(rf"at epoch 1, by step \d+ of {batches}: lower --lr", errors[0]), result.stderr[-3000:]
    assert not (tmp_path / "last.pth").exists()



def records(*epochs: tuple[int, float, float], global_batch: int = 32) -> list[dict]:
    """metrics.jsonl's lines of epochs of (images trained, seconds, seconds waiting for data)."""
    return [{"epoch": i + 1, "train_images_per_sec": images / seconds, "epoch_seconds": seconds,
             "data_wait_seconds": wait, "global_batch_size": global_batch} for i, (images, seconds, wait) in enumerate(epochs)]


def test_the_scaling_summary_of_a_graphed_run_leaves_the_all_reduce_untimed():
    """On a GPU the step is replayed as a CUDA graph, where DDP's timers do not run: the summary
    says so instead of showing the eager warm-up steps' figures as the run's."""
    summary = scaling.summary(records((320, 2.0, 0.5), (320, 2.0, 0.5)), None, 2)  # 2 epochs, 320 images in 2 s
    assert summary["images_per_sec"] == 160 and summary["images_per_sec_per_process"] == 80
    assert summary["step_ms"] == pytest.approx(200) and summary["data_wait_share"] == 0.25
    assert summary["all_reduce_wait_share"] is None and summary["ddp_timers_ms"] is None
    assert "(the all-reduce not timed: DDP timed no step" in scaling.line(summary)


def test_the_summary_is_of_the_runs_epochs_and_says_nothing_for_one_process(tmp_path):
    """--scaling reads the run's epochs from metrics.jsonl: a resumed epoch that trained no step
    (stopped after its last step, found under SLURM) adds its seconds and no images; one process,
    or a run folder without epochs, writes and prints nothing."""
    model = torch.nn.Linear(2, 2)
    two = DistContext(0, 0, 2, 2, torch.device("cpu"), distributed=True)
    scaling.report(tmp_path, model, two)  # no metrics.jsonl
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records((320, 2.0, 0.5), (0, 1.0, 0.0))))
    scaling.report(tmp_path, model, DistContext.single())
    assert not (tmp_path / "scaling.json").exists()
    scaling.report(tmp_path, model, two)
    summary = json.loads((tmp_path / "scaling.json").read_text())
    assert summary["images_per_sec"] == pytest.approx(320 / 3) and summary["data_wait_share"] == pytest.approx(0.5 / 3)


@pytest.mark.slow
def test_ddp_timers_are_read_from_ddp_itself_and_under_compile():
    """The timers come from DDP's own logging data, in ms, also through torch.compile's wrapper
    (not compiled until called); none before DDP timed a step, and none without DDP."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        ddp = DDP(create_model(5))
        assert ddp_timers(ddp) is None  # no step yet
        images, labels = sample_batch(4)
        for _ in range(3):
            torch.nn.functional.cross_entropy(ddp(images.float()), labels).backward()
        timers = ddp_timers(ddp)
        data = ddp._get_ddp_logging_data()
        assert timers["forward_ms"] == data["avg_forward_compute_time"] / 1e6 > 0
        assert timers["all_reduce_ms"] == data["avg_backward_comm_time"] / 1e6 > 0
        assert ddp_timers(torch.compile(ddp)) == timers
        assert ddp_timers(create_model(5)) is None
    finally:
        dist.destroy_process_group()


def test_the_summary_counts_an_optimizer_step_of_accumulated_batches():
    """--accum-steps 4: one all-reduce per 4 batches, so the share is of a step of 4 batches (the
    global batch metrics.jsonl records: batch 8 x 2 processes x 4)."""
    timers = {"forward_ms": 50.0, "backward_ms": 100.0, "all_reduce_ms": 80.0, "hidden_ms": 0.0}
    summary = scaling.summary(records((640, 10.0, 1.0), global_batch=64), timers, 2)
    assert summary["step_ms"] == pytest.approx(1000 * 8 * 4 * 2 / 64)  # 64 img/s in all
    assert summary["all_reduce_wait_share"] == pytest.approx(80 / summary["step_ms"])
    assert "a step of 32 per process took 1000 ms" in scaling.line(summary)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
