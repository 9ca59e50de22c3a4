"""What goes to nvJPEG and what stays with the CPU, the validation images kept on the device in
the loader's order, and --cuda-graph's refusals: the parts of the GPU paths a CPU can check.
tests/test_gpu.py runs the same paths on a GPU."""
from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from conftest import SAMPLE, args_for, user_error
from multi_train_utils.distributed_utils import DistContext, ShardSampler
from my_dataset import MyDataSet, build_transform, eval_resize
from speed import cuda_graph
from speed.gpu_decode import decode_on_gpu, nvjpeg_reads, validation_on_device
import train_single_gpu
from utils import list_images


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory):
    """One file of each kind nvJPEG must not be given, and a baseline colour JPEG it reads."""
    folder = tmp_path_factory.mktemp("odd")
    _, samples = list_images(str(SAMPLE))
    photo = Image.open(samples[0][0]).convert("RGB")
    photo.save(folder / "baseline.jpg", quality=90)
    photo.save(folder / "progressive.jpg", quality=90, progressive=True)
    photo.convert("L").save(folder / "grey.jpg")
    photo.convert("CMYK").save(folder / "cmyk.jpg")
    photo.save(folder / "picture.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to show upright
    photo.save(folder / "rotated.jpg", exif=exif)
    exif[0x0112] = 1  # upright as stored
    photo.save(folder / "upright-exif.jpg", exif=exif)
    (folder / "not-a-picture.jpg").write_bytes(b"not a JPEG")
    return folder


def test_nvjpeg_gets_baseline_colour_jpegs_that_exif_does_not_rotate(odd_files):
    readable = {p.name: nvjpeg_reads(str(p)) for p in sorted(odd_files.iterdir())}
    assert readable == {"baseline.jpg": True, "upright-exif.jpg": True, "progressive.jpg": False, "grey.jpg": False,
                        "cmyk.jpg": False, "picture.png": False, "rotated.jpg": False, "not-a-picture.jpg": False}


def test_the_batched_decode_leaves_the_rest_to_the_cpu(odd_files):
    """On the CPU, decode_jpeg takes the same list: the routing and the order are the GPU's."""
    paths = [str(p) for p in sorted(odd_files.iterdir())]
    pictures = decode_on_gpu(paths, torch.device("cpu"), threads=2)
    decoded = {p.rsplit("/", 1)[1] for p, picture in zip(paths, pictures) if picture is not None}
    assert decoded == {"baseline.jpg", "upright-exif.jpg"}
    baseline = pictures[paths.index(str(odd_files / "baseline.jpg"))]
    assert baseline.dtype == torch.uint8 and baseline.shape[0] == 3


@pytest.mark.parametrize("world_size", [1, 3])
def test_validation_on_the_device_gives_the_loaders_images_in_its_order(world_size, tmp_path, odd_files):
    """Each rank's shard, decoded once and transformed as the dataset does: the same indices,
    labels and pixels as a DataLoader over the same sampler (on the CPU, where both decoders are
    libjpeg's), the files nvJPEG must not read among them."""
    folder = tmp_path / "data"
    shutil.copytree(SAMPLE, folder)
    for name in ("progressive.jpg", "cmyk.jpg", "picture.png", "rotated.jpg"):
        shutil.copy(odd_files / name, folder / "tulips" / name)
    _, samples = list_images(str(folder))
    samples = samples[::4] + [s for s in samples if s[0].rsplit("/", 1)[1] in
                              ("progressive.jpg", "cmyk.jpg", "picture.png", "rotated.jpg")]
    val_set = MyDataSet(samples, build_transform(224, train=False), eval_resize(224))
    for rank in range(world_size):
        ctx = DistContext(rank, rank, world_size, world_size, torch.device("cpu"), distributed=world_size > 1)
        sampler = ShardSampler(len(val_set), ctx)
        kept = validation_on_device(val_set, sampler, 8, ctx, threads=2)
        loader = DataLoader(val_set, batch_size=8, sampler=sampler)
        assert len(kept) == len(loader) and kept.sampler == list(sampler)
        for (pixels, labels), (expected, expected_labels) in zip(kept, loader, strict=True):
            assert torch.equal(labels, expected_labels)
            assert torch.equal(pixels, expected)


def test_cuda_graph_on_is_refused_without_a_gpu_and_beside_what_it_cannot_run_with(capsys):
    message = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), "--device", "cpu", "--cuda-graph", "on"],
                         capsys)
    assert "--cuda-graph on needs a GPU" in message
    assert cuda_graph.blockers(args_for("--accum-steps", "2", "--compile"))[0].startswith("--accum-steps")
    assert len(cuda_graph.blockers(args_for("--accum-steps", "2", "--compile"))) == 2
    assert not cuda_graph.blockers(args_for())


@pytest.mark.parametrize("choice,device,extra,graphed", [
    ("auto", "cuda", [], True), ("auto", "cpu", [], False), ("off", "cuda", [], False),
    ("auto", "cuda", ["--accum-steps", "2"], False), ("auto", "cuda", ["--sync-bn"], False),
    ("on", "cuda", ["--sync-bn"], True), ("on", "cuda", [], True)])
def test_auto_graphs_the_step_on_a_gpu_where_the_options_allow(choice, device, extra, graphed):
    args: argparse.Namespace = args_for("--cuda-graph", choice, *extra)
    assert cuda_graph.wanted(args, torch.device(device)) is graphed


@pytest.mark.parametrize("choice, world_size, graphed", [("auto", 1, True), ("auto", 2, False), ("on", 2, True)])
def test_a_job_of_several_gpus_steps_eagerly_unless_asked(choice, world_size, graphed, monkeypatch):
    """The graphed step under DDP has not run on two GPUs: a process group of several steps
    eagerly by default, one of one process graphs as one process does, and --cuda-graph on is
    obeyed (the group's size is what the rule reads; the GPUs themselves are test_gpu.py's)."""
    monkeypatch.setattr(cuda_graph.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda_graph.dist, "get_world_size", lambda: world_size)
    args: argparse.Namespace = args_for("--cuda-graph", choice)
    assert cuda_graph.wanted(args, torch.device("cuda")) is graphed
