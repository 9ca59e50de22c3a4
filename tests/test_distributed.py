"""Real process groups on CPU (gloo): torchrun and mp.spawn subprocesses, and DDP exactness."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO, SAMPLE, args_for, metrics, ok, sample_batch, train, train_here
from test_launcher_page import EIGHT_STEPS, function_source
from torch.nn.parallel import DistributedDataParallel as DDP

from model import cpu_sync_batchnorm, create_model
from multi_train_utils import distributed_utils
import utils
from multi_train_utils.checkpoint import REQUIRED_KEYS, load_checkpoint
from multi_train_utils.config import check_and_list_images
from multi_train_utils.distributed_utils import DistContext, ShardSampler, init_distributed, teardown
from multi_train_utils.loaders import loaders_of, readable_split
from multi_train_utils.progress import Progress
from multi_train_utils.train_eval_utils import build_optimizer, train_one_epoch
from my_dataset import MyDataSet, build_transform, normalize
from multi_train_utils.distributed_utils import Ranks, find_free_port
from speed.scaling import ScalingTally, ddp_timers
from utils import TrainingDiverged, list_images, load_split

METRIC_KEYS = {"epoch", "train_loss", "train_total", "val_loss", "val_acc", "val_correct", "val_total", "lr",
               "epoch_seconds", "train_images_per_sec", "world_size", "global_batch_size", "data_wait_seconds"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One short training run per launcher, shared by the tests below."""
    root = tmp_path_factory.mktemp("runs")
    results = {}
    # The single launcher's process is not under test here (the original command lines' test
    # starts it, among others): its main() runs in this process.
    results["single"] = (root / "single", ok(train_here(root / "single", "--epochs", "2")))
    # The torchrun run with a breakpoint on each line of the eight steps (tests/breakpoints/).
    (root / "reached").mkdir()
    breakpoints = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "breakpoints"),
                                                               os.environ.get("PYTHONPATH")])),
                   "BREAKPOINTS": ";".join(f"{path}:{line}" for _, _, path, line in step_lines()),
                   "BREAKPOINTS_OUT": str(root / "reached")}
    for launcher, nproc in (("launch", 2), ("spawn", 3)):
        out = root / launcher
        results[launcher] = (out, ok(train(launcher, out, "--epochs", "2", nproc=nproc,
                                           env=breakpoints if launcher == "launch" else None)))
    return results


def step_lines() -> list[tuple[str, str, Path, int]]:
    """Each line of the eight steps (tests/test_launcher_page.py's table): the step, its call, file and line."""
    found = []
    for step, path, function, call in EIGHT_STEPS:
        text = (REPO / path).read_text()
        source = function_source(path, function) if function else text
        start = text.index(source) + source.rindex(call)  # the last: a docstring may name the call first
        line = text.count("\n", 0, start) + 1
        assert call in text.splitlines()[line - 1].partition("#")[0], (step, line)  # code, not a comment
        found.append((step, call, REPO / path, line))
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
def test_a_breakpoint_on_each_of_the_eight_steps_stops_a_default_run(runs):
    """The torchrun run above (2 processes, the defaults but the sizes): a debugger's breakpoint on
    each line of the eight steps is reached, on every rank; rank 0 alone saves. All but SyncBN's:
    --sync-bn is off by default (tests/test_collective_trace.py's run with it records the all_reduce
    of its statistics in each forward)."""
    reached = reached_by_rank(runs["launch"][0].parent / "reached")
    for step, call, path, line in step_lines():
        ranks = {rank for rank in ("0", "1") if f"{path}:{line}" in reached.get(rank, ())}
        expected = set() if step == "SyncBatchNorm" else {"0"} if call == "torch.save(" else {"0", "1"}
        assert ranks == expected, (step, f"{path.name}:{line}", ranks)


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
    assert set(REQUIRED_KEYS) <= ckpt.keys() and ckpt["epoch"] == 2
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
    # A multi-process run ends by saying what its processes bought, measured: the images/s of
    # its epochs, the loop's waits for data, DDP's own timers of the gradients' all-reduce.
    if world_size == 1:
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
    """A run's best checkpoint, evaluated again by 1 or 3 processes over 25 validation images
    (which neither 2 nor 3 divides), gives exactly what the run itself reported: the accuracy and
    loss of that epoch, and the whole evaluation report, which the run made from the outputs its
    best epoch's evaluation kept (a run of 2 processes and one of 3; an evaluation in 1 process,
    here in this one, makes its report as a 1-process run does)."""
    for trained, evaluations in (("launch", ((1, "single"), (3, "spawn"))), ("spawn", ((1, "single"),))):
        out, _ = runs[trained]
        best_epoch = load_checkpoint(out / "best.pth")["epoch"]
        reported = metrics(out)[best_epoch - 1]
        run_report = json.loads((out / "report.json").read_text())
        assert run_report["weights"] == f"{out / 'best.pth'} (epoch {best_epoch})"
        for world_size, launcher in evaluations:
            again = tmp_path / f"{trained}-{world_size}"
            argv = ("--eval-only", "--resume", str(out / "best.pth"), "--plots")
            ok(train_here(again, *argv) if launcher == "single" else train(launcher, again, *argv, nproc=world_size))
            result = json.loads((again / "eval.json").read_text())
            assert result["val_total"] == 25
            assert result["val_correct"] == reported["val_correct"]
            assert result["val_loss"] == pytest.approx(reported["val_loss"], rel=1e-5)
            report = json.loads((again / "report.json").read_text())
            for key in ("images", "accuracy", "macro_f1", "per_class", "top_k_accuracy", "confusion_matrix"):
                assert report[key] == run_report[key], (trained, world_size, key)
            assert report["world_size"] == world_size and report["images"] == 25
        assert (tmp_path / f"{trained}-{evaluations[0][0]}" / "confusion_matrix.png").is_file()


# Training images drawn in an epoch of the 95-image split, 8 per batch, by world size (docs/exactness.md).
SEEN = {1: 88, 2: 96, 3: 96}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_training_image_is_drawn_once_an_epoch_less_the_dropped_plus_the_padding(world_size):
    """The training loaders of all ranks together: each image once an epoch, except that the
    DistributedSampler repeats the first images of its shuffle until every rank has as many, and a
    rank's last batch is dropped when shorter than --batch-size (while the shard is longer than one)."""
    plan = check_and_list_images(args_for("--workers", "0", "--batch-size", "8"), "test", verbose=False)
    split = readable_split(plan, DistContext.single())
    n, per_rank = len(split.train), -(-len(split.train) // world_size)  # 95, and ceil(95 / world_size)
    padding, kept = world_size * per_rank - n, per_rank - per_rank % 8
    loaders = [loaders_of(split, plan, DistContext(r, r, world_size, world_size, torch.device("cpu"), True))
               for r in range(world_size)]
    missed_by_epoch = []
    for epoch in (1, 2):
        drawn = []
        for loader, _, sampler in loaders:
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
    """The math threads one of `processes` CPU processes on a 32-core machine sets itself, in
    the environment `env` and with a launcher started in `launcher_env` (None: unreadable)."""
    before = torch.get_num_threads()
    monkeypatch.setattr(utils, "cpu_count", lambda: 32)  # a 32-core machine, this process bound to none
    monkeypatch.setattr(os, "cpu_count", lambda: 32)

    def threads(processes: int, env: dict[str, str], launcher_env: dict[str, str] | None = None) -> int:
        for key in ("OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(distributed_utils, "_launcher_environ", lambda: launcher_env)
        torch.set_num_threads(7)  # a value none of the cases sets
        distributed_utils._configure_threads(torch.device("cpu"), processes)
        return torch.get_num_threads()

    yield threads
    torch.set_num_threads(before)


def test_each_cpu_process_gets_its_share_of_the_cores(threads_of):
    torchrun = {"TORCHELASTIC_RUN_ID": "none"}
    assert threads_of(2, {}) == 16  # mp.spawn exports nothing
    # torchrun's own OMP_NUM_THREADS=1: set in torchrun, absent from the environment it started with
    assert threads_of(2, {**torchrun, "OMP_NUM_THREADS": "1"}, launcher_env={}) == 16
    assert threads_of(2, {**torchrun, "OMP_NUM_THREADS": "1"}, launcher_env=None) == 16  # no /proc: the rule
    # the user's choice: given to torchrun, or any other value, or outside torchrun
    assert threads_of(2, {**torchrun, "OMP_NUM_THREADS": "1"}, launcher_env={"OMP_NUM_THREADS": "1"}) == 7
    assert threads_of(2, {**torchrun, "OMP_NUM_THREADS": "3"}, launcher_env={"OMP_NUM_THREADS": "3"}) == 7
    assert threads_of(2, {"OMP_NUM_THREADS": "1"}) == 7
    assert threads_of(1, {**torchrun, "OMP_NUM_THREADS": "1"}, launcher_env={}) == 7  # torchrun sets it for 2+ only


@pytest.mark.slow
def test_the_launcher_environment_is_the_one_it_started_with():
    """As torchrun does, a launcher sets a variable after it started, then starts a worker:
    the worker finds what the launcher was given, not what it set itself."""
    worker = "from multi_train_utils.distributed_utils import _launcher_environ as e; l = e(); print(l['GIVEN'], 'SET' in l)"
    launcher = f"import os, subprocess, sys; os.environ['SET'] = '1'; subprocess.run([sys.executable, '-c', {worker!r}])"
    out = subprocess.run([sys.executable, "-c", launcher], cwd=REPO, env={**os.environ, "GIVEN": "yes"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["yes", "False"], out.stderr


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
    optimizer, scaler, _ = build_optimizer(module, args, ctx.device)
    train_one_epoch(model, torch.nn.CrossEntropyLoss(label_smoothing=0.1), optimizer, scaler, [(images, labels)], 1,
                    Progress(), args, ctx)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _ddp_worker(rank: int, port: int, out_dir: str, per_rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = init_distributed(Ranks(rank, rank, 2, 2), "cpu", "gloo", 120)
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
        teardown()


@pytest.mark.slow
def test_ddp_with_sync_bn_takes_the_same_step_as_one_process(tmp_path):
    """Two ranks with batch b and SyncBN end one optimizer step with the parameters (and
    BatchNorm statistics) of one process with batch 2b; without SyncBN they do not.

    In float64, so the comparison sees the update rule and not rounding: in float32 the first
    step from random weights, with BatchNorm over 8 values per channel in the last stage,
    amplifies rounding to about 1e-4 in both runs alike (float64 agrees to 1e-13)."""
    per_rank = 4
    mp.spawn(_ddp_worker, args=(find_free_port(), str(tmp_path), per_rank), nprocs=2)
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
    assert len(errors) == nproc and "epoch 1, step" in errors[0], result.stderr[-3000:]
    assert not (tmp_path / "last.pth").exists()



def test_the_scaling_summary_of_a_graphed_run_leaves_the_all_reduce_untimed(tmp_path):
    """On a GPU the step is replayed as a CUDA graph, where DDP's timers do not run: the summary
    says so instead of showing the eager warm-up steps' figures as the run's."""
    tally = ScalingTally(2, 16)
    for _ in range(2):  # two epochs of 320 images in 2 s each
        tally.add({"train_images": 320, "seconds": 2.0, "data_wait_seconds": 0.5, "ddp_timers": None})
    tally.report(tmp_path)
    summary = json.loads((tmp_path / "scaling.json").read_text())
    assert summary["images_per_sec"] == 160 and summary["images_per_sec_per_process"] == 80
    assert summary["step_ms"] == pytest.approx(200) and summary["data_wait_share"] == 0.25
    assert summary["all_reduce_wait_share"] is None and summary["ddp_timers_ms"] is None
    one = ScalingTally(1, 16)
    one.add({"train_images": 320, "seconds": 2.0, "data_wait_seconds": 0.5})
    one.report(tmp_path / "missing")  # one process: nothing to say, nothing written


def test_a_run_resumed_after_its_last_step_has_no_scaling_summary(tmp_path):
    """Stopped after the last step of its last epoch (found under SLURM, where a SIGTERM lands
    on any step), the requeued run trains nothing: no summary, and no division by its 0 images.
    A resumed epoch with no step left adds nothing to a later epoch's figures."""
    untimed = {"train_images": 0, "seconds": 11.0, "data_wait_seconds": 0.0}
    tally = ScalingTally(2, 16)
    tally.add(untimed)
    tally.report(tmp_path)
    assert not (tmp_path / "scaling.json").exists()
    tally.add({"train_images": 320, "seconds": 2.0, "data_wait_seconds": 0.5, "ddp_timers": None})
    assert tally.summary()["images_per_sec"] == 160 and tally.summary()["data_wait_share"] == 0.25


@pytest.mark.slow
def test_ddp_timers_are_read_from_ddp_itself_under_compile_and_not_under_a_graph():
    """The timers come from DDP's own logging data, in ms, also through torch.compile's wrapper
    (not compiled until called); none for a replayed graph; nothing without DDP."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        ddp = DDP(create_model(5))
        images, labels = sample_batch(4)
        for _ in range(3):
            torch.nn.functional.cross_entropy(ddp(images.float()), labels).backward()
        timers = ddp_timers(ddp, graphed=False)["ddp_timers"]
        data = ddp._get_ddp_logging_data()
        assert timers["forward_ms"] == data["avg_forward_compute_time"] / 1e6 > 0
        assert timers["all_reduce_ms"] == data["avg_backward_comm_time"] / 1e6 > 0
        assert ddp_timers(torch.compile(ddp), graphed=False) == {"ddp_timers": timers}
        assert ddp_timers(ddp, graphed=True) == {"ddp_timers": None}
        assert ddp_timers(create_model(5), graphed=False) == {}
    finally:
        dist.destroy_process_group()


def test_the_summary_counts_an_optimizer_step_of_accumulated_batches():
    """--accum-steps 4: one all-reduce per 4 batches, so the share is of a step of 4 batches."""
    tally = ScalingTally(2, 8, accum_steps=4)
    timers = {"forward_ms": 50.0, "backward_ms": 100.0, "all_reduce_ms": 80.0, "hidden_ms": 0.0}
    tally.add({"train_images": 640, "seconds": 10.0, "data_wait_seconds": 1.0, "ddp_timers": timers})
    summary = tally.summary()
    assert summary["step_ms"] == pytest.approx(1000 * 8 * 4 * 2 / 64)  # 64 img/s in all
    assert summary["all_reduce_wait_share"] == pytest.approx(80 / summary["step_ms"])
    assert "a step of 32 per process took 1000 ms" in tally.line(summary)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
