"""--device-augment: the training images on the device, cropped and flipped there for the
whole batch at once, by the same draws as the loader's transform. Run on the CPU here; the
code is the same on a GPU."""
from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import args_for
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.transforms.v2 import functional as TF

from multi_train_utils.config import list_images_of
from multi_train_utils.distributed_utils import DistContext, Ranks, ShardSampler, loader_options, process_context
from my_dataset import CropDraws, DeviceCrops, EpochKeys, MyDataSet, normalize, train_and_val_sets, train_transforms
from recipe import extras
from speed.device_augment import DeviceAugmentedLoader, check_device_room
from utils import UserError, split_samples

SINGLE = DistContext.single()
LEVEL = 1 / (255 * 0.229)  # one grey level of the red channel (the smallest std) after normalisation


def ramp(size: int) -> torch.Tensor:
    """A picture whose red value is 3 * x, green 3 * y and blue x + y: its pixels say where they came from."""
    y, x = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    return torch.stack([3 * x, 3 * y, x + y]).to(torch.uint8)


@pytest.mark.parametrize("box, flip, size", [
    ((5, 7, 40, 30), False, 48),  # enlarged
    ((10, 3, 20, 50), True, 96),  # enlarged, mirrored
    ((0, 0, 64, 64), True, 80),  # the whole picture
    ((8, 2, 56, 60), False, 40),  # shrunk
])
def test_a_crop_is_torchvisions_resized_crop_and_flip(box, flip, size):
    picture = ramp(64)
    crops = DeviceCrops(picture[None], torch.tensor([[64, 64]]))
    cut = crops(torch.tensor([[0, *box, int(flip)]]), size)[0]
    expected = TF.resized_crop(picture, *box, [size, size], antialias=True)
    if flip:
        expected = TF.horizontal_flip(expected)
    # Within rounding to bytes (the loader's crop is rounded; the device's is not).
    assert (cut - normalize(expected[None].clone())[0]).abs().max() < 1.5 * LEVEL


def find_free_port() -> int:
    """A port nothing listens on now, on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_loaders(args, ctx: DistContext):
    """The sample's split, and its training and validation loaders and sampler, built by the
    launchers' lines (--cache and --device-augment included)."""
    plan = list_images_of(args, "single", verbose=False)
    split = split_samples(plan.samples, plan.class_names, args.val_rate, args.seed, plan.val_files)
    train_set, val_set = train_and_val_sets(split, args)
    if args.cache or args.device_augment:
        train_set, val_set = extras.decoded_once(split, train_set, val_set, args, ctx)
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    options = loader_options(args, ctx)
    train_loader = DataLoader(train_set, sampler=EpochKeys(sampler), **options,
                              drop_last=len(sampler) > args.batch_size)
    val_loader = DataLoader(val_set, sampler=ShardSampler(len(val_set), ctx), **options)
    if args.device_augment:
        train_loader, val_loader = extras.device_loaders(train_loader, val_loader, args, ctx)
    return plan, split, train_loader, val_loader, sampler


def loaders(*argv: str):
    """One process's: the plan, the split, the training and validation loaders, the sampler."""
    return launcher_loaders(args_for("--workers", "0", "--batch-size", "8", *argv), SINGLE)


@pytest.mark.parametrize("crop_scale", ["0.08", "0.35"])
def test_the_device_crops_what_the_loader_crops(crop_scale):
    """Real photos, drawn as the loader's transform draws them from the same --cache pixels:
    every crop shows the same part of the same picture, mirrored alike (within resampling),
    whatever the smallest share of the picture a crop may take."""
    plan, split, loader, val_loader, sampler = loaders("--img-size", "64", "--cache", "--device-augment",
                                                       "--crop-scale", crop_scale)
    assert isinstance(loader, DeviceAugmentedLoader)
    on_cpu = MyDataSet(split.train, train_transforms(vars(plan.args)), 64, plan.args.seed, val_loader.dataset.cache)
    sampler.set_epoch(3)
    draws, labels = next(iter(loader.draws))
    for row, image in zip(draws.tolist(), loader.crops(draws, 64)):
        same, other = (normalize(on_cpu[(epoch, row[0])][0][None].clone())[0] for epoch in (3, 4))
        assert (image - same).abs().mean() < 6 * LEVEL, row
        assert (image - other).abs().mean() > 15 * LEVEL, "another epoch's crop should differ"
    assert labels.tolist() == [split.train[row[0]][1] for row in draws.tolist()]


def test_an_epoch_started_part_way_gives_the_rest_of_the_same_batches():
    """What resuming inside an epoch relies on: skipping the trained samples leaves the
    following batches exactly as they were, pixels and labels."""
    _, _, loader, _, sampler = loaders("--img-size", "32", "--device-augment", "--min-img-size", "16",
                                       "--ramp-epochs", "2")
    sampler.set_epoch(1)
    whole = list(loader)
    assert whole[0][0].shape == (8, 3, 16, 16)  # the ramp's first size
    loader.sampler.skip_next_pass(2 * 8)
    assert len(loader) == len(whole) - 2
    rest = list(loader)
    assert len(rest) == len(whole) - 2 and len(loader) == len(whole)  # the skip is the next pass's only
    for (a, la), (b, lb) in zip(whole[2:], rest):
        assert torch.equal(a, b) and torch.equal(la, lb)
    sampler.set_epoch(2)
    assert next(iter(loader))[0].shape == (8, 3, 32, 32)


def test_pixels_that_would_not_fit_are_refused():
    with pytest.raises(UserError, match="--device-augment keeps the training images on cpu: .* GiB"):
        check_device_room(10**15, SINGLE)


def _rank(rank: int, port: int, out: str) -> None:
    """One rank of two, in a process group made as the spawn launcher makes it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = process_context(Ranks(rank, rank, 2, 2), "cpu", "gloo")
    dist.init_process_group(ctx.backend, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        args = args_for("--workers", "0", "--batch-size", "8", "--img-size", "32", "--device-augment")
        _, _, loader, _, sampler = launcher_loaders(args, ctx)
        sampler.set_epoch(1)
        cuts = {row[0]: image for draws, _ in loader.draws for row, image in zip(draws.tolist(), loader.crops(draws, 32))}
        torch.save({"pixels": loader.crops.pixels, "cuts": cuts}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_hold_the_pixels_of_one_and_cut_the_same_crops(tmp_path):
    """Two ranks of a real gloo group each decode half the images and sum: both end with the
    pixels one process decodes alone, and each image's crop in an epoch is the one it gets in
    one process, whichever rank draws it."""
    mp.spawn(_rank, args=(find_free_port(), str(tmp_path)), nprocs=2)
    _, _, loader, _, sampler = loaders("--img-size", "32", "--device-augment")
    sampler.set_epoch(1)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in (0, 1)]
    for rank in ranks:
        assert torch.equal(rank["pixels"], loader.crops.pixels)
    cuts = {**ranks[0]["cuts"], **ranks[1]["cuts"]}
    assert len(cuts) == 95  # 48 per rank: the sampler pads with one image, which both ranks then crop alike
    for draws, _ in loader.draws:
        for row, image in zip(draws.tolist(), loader.crops(draws, 32)):
            if row[0] in cuts:
                torch.testing.assert_close(cuts[row[0]], image, rtol=0, atol=1e-5)


def test_crop_scale_is_the_smallest_share_a_crop_takes():
    """--crop-scale 0.5: no box under half the picture (torchvision's draws, our seeds); the
    default 0.08 cuts far smaller ones."""
    frames = [(300, 400)] * 200
    samples = [("x.jpg", 0)] * len(frames)

    def areas(crop_scale: float) -> list[float]:
        draws = CropDraws(samples, frames, seed=0, crop_scale=crop_scale)
        return [(lambda r: r[3] * r[4] / (300 * 400))(draws[(1, i)][0].tolist()) for i in range(len(frames))]

    assert min(areas(0.5)) >= 0.5 - 0.01  # boxes are whole pixels
    assert min(areas(0.08)) < 0.2
