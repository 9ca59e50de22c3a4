"""The CUDA path, on a machine with one GPU: every launcher, --check's NCCL stages, bf16 autocast, channels_last, pinned
uint8 batches, nn.SyncBatchNorm, torch.compile, evaluation against the CPU's, checkpoints that
move between GPU and CPU, and predict.py. Skipped where CUDA is absent (CI has no GPU).

Two DDP ranks on one GPU are not run: NCCL refuses two ranks on one device, and the launchers
give each process the GPU of its local rank. The multi-rank logic (samplers, reductions,
SyncBN's arithmetic, faults) is covered on the CPU with gloo by the rest of the suite.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys

import pytest
import torch
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
import torch.distributed as dist
from test_collective_trace import contradictions, read_list
from test_device_augment import launcher_loaders
from conftest import SAMPLE, call_main, kill_group, launcher_cmd, metrics, ok, run_cli, start, train, wait_for_epochs

import predict
from model import create_model
from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.config import get_args_parser
from multi_train_utils.distributed_utils import DistContext, autocast_dtype, job_precision
from multi_train_utils.train_eval_utils import Progress, build_optimizer, model_input, train_one_epoch
from my_dataset import DeviceCrops, decode
from recipe import extras
from speed.gpu_decode import DeviceBatches, decode_on_gpu
from utils import list_images

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.slow,
              pytest.mark.gpu]

ON_GPU = ["--device", "cuda", "--img-size", "64", "--batch-size", "16", "--workers", "2"]
CUDA = torch.device("cuda", 0)


def placed(module: torch.nn.Module, args) -> torch.dtype | None:
    """`module` on the GPU in the layout --channels-last asks, and the job's precision, as the launchers do."""
    module.to(CUDA, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    return job_precision(args.amp, DistContext.single(CUDA))


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "run"
    result = ok(train("single", out, "--epochs", "2", "--report", *ON_GPU))
    return out, result.stdout


def test_single_process_trains_with_bf16_and_channels_last(gpu_run):
    out, stdout = gpu_run
    expected = "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    assert f"precision: {expected} autocast\n" in stdout
    # The weights trained (and saved) in channels_last: a 4-D weight's strides say so.
    saved = load_checkpoint(out / "last.pth")["model"]["conv1.weight"]
    assert saved.is_contiguous(memory_format=torch.channels_last) and not saved.is_contiguous()
    assert [r["epoch"] for r in metrics(out)] == [1, 2]
    assert (out / "report.json").is_file() and "report on " in stdout


@pytest.mark.parametrize("launcher", ["launch", "spawn"])
def test_the_ddp_launchers_train_on_one_gpu(launcher, tmp_path):
    result = ok(train(launcher, tmp_path, "--epochs", "1", *ON_GPU, nproc=1))
    assert "backend=nccl" in result.stdout
    assert metrics(tmp_path)[0]["world_size"] == 1


def test_batches_travel_pinned_as_uint8_and_become_float_on_the_gpu():
    args = get_args_parser("test").parse_args(["--data-path", str(SAMPLE), *ON_GPU])
    ctx = DistContext.single(CUDA)
    _, _, train_loader, _, sampler = launcher_loaders(args, ctx)
    sampler.set_epoch(1)
    images, labels = next(iter(train_loader))
    assert images.dtype == torch.uint8 and images.is_pinned()
    batch = model_input(images, CUDA, args.channels_last)
    assert batch.device.type == "cuda" and batch.dtype == torch.float32
    assert batch.is_contiguous(memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = False
    extras.prepare_gpu(args, ctx)  # as the launchers call it on a GPU
    assert torch.backends.cudnn.benchmark
    torch.cuda.set_stream(torch.cuda.default_stream(CUDA))  # the side stream a graphed step would be captured on


def test_sync_bn_becomes_torch_syncbatchnorm_and_trains():
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), device_id=CUDA)
    try:
        args = get_args_parser("test").parse_args(["--data-path", str(SAMPLE), *ON_GPU, "--sync-bn", "--epochs", "1"])
        ctx = DistContext(0, 0, 1, 1, CUDA, distributed=True)
        module = create_model(5)
        amp_dtype = placed(module, args)
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)  # as the launchers convert it
        model = DistributedDataParallel(module, device_ids=[CUDA.index])
        optimizer, scaler = build_optimizer(module, args, amp_dtype)
        assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())
        batch = (torch.randint(0, 256, (16, 3, 64, 64), dtype=torch.uint8), torch.randint(0, 5, (16,)))
        result = train_one_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, scaler, [batch, batch], 1, Progress(),
                                 amp_dtype, args, ctx)
        assert torch.isfinite(torch.tensor(result.train_loss))
    finally:
        dist.destroy_process_group()


def test_device_augment_cuts_on_the_gpu_what_it_cuts_on_the_cpu(tmp_path):
    """The GPU decodes the pictures with nvJPEG and resizes them there, the CPU with libjpeg and
    Pillow: the squares land within a few grey levels, the frames are the same. Given the same pixels and draws, the GPU's crops
    are the CPU's (bilinear sampling in fp32 on either); and a run with them trains."""
    args = get_args_parser("test").parse_args(["--data-path", str(SAMPLE), *ON_GPU, "--device-augment"])
    loaders = {}
    for device in (CUDA, torch.device("cpu")):
        ctx = DistContext.single(device)
        _, _, loader, val_loader, sampler = launcher_loaders(args, ctx)
        sampler.set_epoch(1)
        loaders[device.type] = loader, val_loader
    gpu, cpu = loaders["cuda"][0], loaders["cpu"][0]
    apart = (gpu.crops.pixels.cpu().float() - cpu.crops.pixels.float()).abs().mean(dim=(1, 2, 3))
    # Measured on an H200 (torch 2.11): 1.3 grey levels apart on average, 4.5 for the farthest picture.
    print(f"device-augment squares: {apart.mean():.2f} grey levels apart on average, {apart.max():.2f} at most")
    assert apart.mean() < 2 and apart.max() < 6, (apart.mean(), apart.max())
    assert torch.equal(gpu.crops.frames.cpu(), cpu.crops.frames.cpu())
    gpu.crops = DeviceCrops(cpu.crops.pixels.to(CUDA), cpu.crops.frames.to(CUDA))
    crops = {}
    for name, loader in (("cuda", gpu), ("cpu", cpu)):
        images, _ = next(iter(loader))
        assert images.device.type == name and images.dtype == torch.float32
        crops[name] = images.cpu()
    torch.testing.assert_close(crops["cuda"], crops["cpu"], rtol=0, atol=1e-3)
    # The validation images wait on the GPU: the same images, labels and order as the CPU's loader.
    kept, val_loader = loaders["cuda"][1], loaders["cpu"][1]
    assert isinstance(kept, DeviceBatches) and list(kept.sampler) == list(val_loader.sampler)
    val_apart = []
    for (pixels, labels), (expected, expected_labels) in zip(kept, val_loader, strict=True):
        assert pixels.is_cuda and torch.equal(labels.cpu(), expected_labels)
        val_apart.append((pixels.cpu().float() - expected.float()).abs().mean().item())
    print(f"validation batches kept on the GPU: {max(val_apart):.2f} grey levels apart at most (batch means)")
    assert max(val_apart) < 3, val_apart
    ok(train("single", tmp_path, "--epochs", "1", *ON_GPU, "--device-augment"))
    assert len(metrics(tmp_path)) == 1


def test_nvjpeg_decodes_what_it_reads_and_leaves_the_rest_to_the_cpu(tmp_path):
    """Baseline colour JPEGs by nvJPEG, within a few grey levels of libjpeg; a progressive, a
    greyscale, a CMYK and an EXIF-rotated JPEG and a PNG by the CPU."""
    _, samples = list_images(str(SAMPLE))
    photo = Image.open(samples[0][0]).convert("RGB")
    photo.save(tmp_path / "progressive.jpg", progressive=True)
    photo.convert("L").save(tmp_path / "grey.jpg")
    photo.convert("CMYK").save(tmp_path / "cmyk.jpg")
    photo.save(tmp_path / "picture.png")
    exif = Image.Exif()
    exif[0x0112] = 6
    photo.save(tmp_path / "rotated.jpg", exif=exif)
    odd = sorted(str(p) for p in tmp_path.iterdir())
    baseline = [p for p, _ in samples[:40]]
    pictures = decode_on_gpu(baseline + odd, CUDA, threads=4)
    assert all(p is None for p in pictures[len(baseline):])
    apart = []
    for path, picture in zip(baseline, pictures):
        assert picture.is_cuda
        apart.append((picture.cpu().float() - decode(path, 10_000).float()).abs().mean().item())
    print(f"nvJPEG against libjpeg: {sum(apart) / len(apart):.2f} grey levels apart on average, {max(apart):.2f} at most")
    assert max(apart) < 2, apart


def step_losses(choice: str, amp: str, ddp_options: dict | None) -> list[float]:
    """Twenty steps, each its own one-batch epoch (a batch of 5 at step 15, run eagerly between
    replays), with deterministic kernels: the loss of every step, eager or graphed."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8, generator=generator),
                torch.randint(0, 5, (n,), generator=generator)) for n in [16] * 14 + [5] + [16] * 5]
    args = get_args_parser("test").parse_args(["--data-path", str(SAMPLE), *ON_GPU, "--amp", amp,
                                               "--cuda-graph", choice, "--epochs", "20", "--warmup-epochs", "0"])
    torch.cuda.set_stream(torch.cuda.default_stream(CUDA))
    torch.manual_seed(0)
    module = create_model(5)
    module.to(CUDA, memory_format=torch.channels_last)
    amp_dtype = autocast_dtype(amp, CUDA)
    ctx = DistContext.single(CUDA) if ddp_options is None else DistContext(0, 0, 1, 1, CUDA, distributed=True)
    extras.prepare_gpu(args, ctx)  # as the launchers do, before the DDP wrap: the side stream a graph is captured on
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    model = module if ddp_options is None else DistributedDataParallel(module, device_ids=[0], **ddp_options)
    optimizer, scaler = build_optimizer(module, args, amp_dtype)
    extra = extras.training_extras(model, module, optimizer, None, args, ctx)  # the graphed step, where wanted
    losses = [train_one_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, scaler, [batch], epoch,
                              Progress(last_epoch=20), amp_dtype, args, ctx, extra).train_loss
              for epoch, batch in enumerate(batches, start=1)]
    step = extra.graph
    assert (step is not None and step.graph is not None) == (choice == "on")  # "on" did replay
    torch.cuda.synchronize()
    torch.cuda.set_stream(torch.cuda.default_stream(CUDA))
    torch.backends.cudnn.deterministic = False
    return losses


@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
def test_each_replayed_step_is_the_eager_step(amp):
    """Step by step, deterministic kernels: the replays' losses are the eager steps' (step 4 is
    captured and replayed; step 15 is an eager step of another size between replays)."""
    eager, graphed = step_losses("off", amp, None), step_losses("on", amp, None)
    print(f"\n{amp} eager  ", " ".join(f"{x:.6f}" for x in eager), f"\n{amp} graphed", " ".join(f"{x:.6f}" for x in graphed))
    torch.testing.assert_close(graphed, eager, rtol=1e-4 if amp == "off" else 1e-2, atol=0)


@pytest.mark.parametrize("options", [{}, {"gradient_as_bucket_view": True}, {"broadcast_buffers": False}],
                         ids=["plain", "bucket-view", "no-buffer-broadcast"])
def test_each_replayed_step_under_ddp_is_the_eager_step(options, monkeypatch):
    """The same under DDP (one process, NCCL, in this process): DDP's all-reduce captured in the
    graph after its eleven eager warm-up steps (step 12 is captured and replayed)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=CUDA)
    try:
        eager, graphed = step_losses("off", "bf16", options), step_losses("on", "bf16", options)
    finally:
        dist.destroy_process_group()
    print(f"\nddp {options} eager  ", " ".join(f"{x:.6f}" for x in eager),
          f"\nddp {options} graphed", " ".join(f"{x:.6f}" for x in graphed))
    torch.testing.assert_close(graphed, eager, rtol=1e-2, atol=0)


def test_the_launcher_trains_with_the_graphed_step_under_ddp(tmp_path):
    """torchrun, one process, NCCL: the step captured with DDP's all-reduce in it (from the third
    epoch on, every batch is a replay). The losses are not compared with an eager run's here:
    cuDNN's autotuned, non-deterministic kernels make two eager runs part too; the tests above
    compare the steps themselves, with deterministic kernels."""
    result = ok(train("launch", tmp_path, "--epochs", "3", *ON_GPU, "--cuda-graph", "on", nproc=1))
    assert "training step: a CUDA graph" in result.stdout
    losses = [r["train_loss"] for r in metrics(tmp_path)]
    assert len(losses) == 3 and all(0 < loss < 5 for loss in losses), losses


def test_compile_on_cuda(tmp_path):
    ok(train("single", tmp_path, "--epochs", "1", *ON_GPU, "--compile", timeout=900))
    assert len(metrics(tmp_path)) == 1


def test_evaluation_on_the_gpu_agrees_with_the_cpu(gpu_run, tmp_path):
    """The same checkpoint, evaluated in fp32 on the GPU and on the CPU. cuDNN's TF32 and other
    kernels round differently, which may flip a borderline image: at most one of 25."""
    out, _ = gpu_run
    counts = {}
    for device in ("cuda", "cpu"):
        ok(train("single", tmp_path / device, "--eval-only", "--resume", str(out / "best.pth"), "--device", device,
                 "--img-size", "64"))
        counts[device] = json.loads((tmp_path / device / "eval.json").read_text())["val_correct"]
    assert abs(counts["cuda"] - counts["cpu"]) <= 1, counts


def test_a_checkpoint_moves_from_gpu_to_cpu_and_back(gpu_run, tmp_path):
    """An epoch's checkpoint resumes on the GPU, then on the CPU, then on the GPU again: the
    resume lays the momentum buffers out as this run's parameters, whatever layout the file
    holds (CUDA's fused channels_last step refuses buffers laid out otherwise)."""
    out, _ = gpu_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    ok(train("single", run, "--epochs", "3", "--resume", "auto", *ON_GPU))
    ok(train("single", run, "--epochs", "4", "--resume", "auto", "--device", "cpu", "--img-size", "64",
             "--batch-size", "16"))
    ok(train("single", run, "--epochs", "5", "--resume", "auto", *ON_GPU))
    assert [r["epoch"] for r in metrics(run)] == [1, 2, 3, 4, 5]


def test_predict_on_the_gpu(gpu_run, capsys):
    out, _ = gpu_run
    tops = {}
    for device in ("cuda", "cpu"):
        with pytest.raises(SystemExit) as exit_info:
            call_main(predict.main, ["--checkpoint", str(out / "best.pth"), str(SAMPLE), "--json", "--top-k", "1",
                                     "--device", device, "--workers", "0"])
        assert exit_info.value.code == 0
        tops[device] = [json.loads(line)["top"][0]["class"] for line in capsys.readouterr().out.splitlines()]
    assert len(tops["cuda"]) == 120
    assert sum(a != b for a, b in zip(tops["cuda"], tops["cpu"])) <= 2, "GPU and CPU disagree beyond rounding"


def test_the_throughput_benchmark_runs_on_the_gpu(tmp_path):
    out = tmp_path / "gpu-throughput.json"
    ok(run_cli([sys.executable, "-m", "benchmarks", "throughput", "--data-path", str(SAMPLE), "--img-size", "64",
                "--world-sizes", "1", "--steps", "3", "--warmup", "2", "--repeats", "1", "--out", str(out)],
               timeout=900))
    result = json.loads(out.read_text())
    assert result["machine"]["gpu"]
    # A failed measurement is recorded as {"error": ...} and the benchmark still exits 0.
    assert result["measurements"] and not [m["error"] for m in result["measurements"] if "error" in m]
    assert all(m["device"].startswith("cuda") for m in result["measurements"])


def test_the_collective_recorder_on_nccl(tmp_path):
    """--trace-collectives under torchrun with NCCL (one process: NCCL refuses two ranks on one
    GPU). The traced run steps eagerly, DDP's gradient all-reduces are recorded with their CUDA
    tensors' bytes, and every recorded collective is named on its launcher line and in the tour,
    as on gloo (tests/test_collective_trace.py)."""
    result = ok(train("launch", tmp_path, "--epochs", "1", *ON_GPU, "--trace-collectives", nproc=1))
    print(result.stdout[-3000:])
    assert "backend=nccl" in result.stdout
    assert "training step: a CUDA graph" not in result.stdout  # traced: eager, its collectives seen
    rows = read_list(tmp_path / "collectives" / "rank0.tsv")
    ddp = [r for r in rows if r["via"].endswith("torch:_allreduce_fut")]
    assert ddp and all(int(r["bytes"]) > 0 for r in ddp), rows
    problems, _ = contradictions({"nccl": rows})
    assert not problems, "\n".join(problems)


def test_check_runs_its_nccl_stages_on_the_gpu(tmp_path):
    """--check under torchrun on the GPU: the device, the NCCL all-reduce checked, the versions
    read (NCCL's and the driver's, which the CPU tests cannot see)."""
    result = ok(train("launch", tmp_path / "out", *ON_GPU, "--check", "--check-timeout", "60", nproc=1))
    assert "check: a job would run" in result.stdout
    assert re.search(r"device +ok +cuda:0, nccl", result.stdout), result.stdout
    assert re.search(r"all-reduce +ok +nccl, 1 processes, sum checked", result.stdout), result.stdout
    assert "NCCL -" not in result.stdout and "driver -" not in result.stdout


def test_sigterm_to_torchrun_under_nccl_with_the_default_loader_workers(tmp_path):
    """A preemption on a GPU node: SIGTERM to torchrun's whole process group (as slurmstepd and
    `docker stop` send it), NCCL, the default loader workers. The rank saves its position inside
    the epoch (torchrun, signalled itself, reports its own exit code, 1); the job resumes there."""
    steps = ["--epochs", "3", "--batch-size", "2", "--img-size", "64", "--no-plots", "--device", "cuda"]
    cmd = launcher_cmd("launch", 1) + ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path), *steps]
    proc = start(cmd)
    try:
        wait_for_epochs(proc, tmp_path, 1, timeout=300)
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    code = proc.returncode
    print(err[-1500:])
    assert "backend=nccl" in out
    assert err.count("stopped: SIGTERM: every process stopped after step") == 1, err[-3000:]
    assert code == 1, err[-3000:]
    checkpoint = load_checkpoint(tmp_path / "last.pth")
    assert checkpoint["steps_in_epoch"] > 0 and checkpoint["epoch"] == len(metrics(tmp_path))
    out = ok(train("launch", tmp_path, *steps, "--resume", "auto", fast=[])).stdout
    assert f"goes on after step {checkpoint['steps_in_epoch']}" in out
    assert [r["epoch"] for r in metrics(tmp_path)] == [1, 2, 3]
