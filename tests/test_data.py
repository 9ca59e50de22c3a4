"""Image decoding, folder scanning and the split, on real files."""
from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch
from conftest import (FAST_DEFAULT_WORKERS, REPO, SAMPLE, args_for, copy_sample, metrics, ok,
                      processes_with_marker, train, train_here)
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.transforms import v2

import my_dataset
from multi_train_utils import distributed_utils
from multi_train_utils.config import list_images_of
from multi_train_utils.distributed_utils import DistContext, Ranks, ShardSampler, cpus_per_process, loader_options
from multi_train_utils.train_eval_utils import model_input
from my_dataset import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EpochKeys,
    MyDataSet,
    build_transform,
    normalize,
    train_and_val_sets,
)
from utils import UserError, find_unreadable, list_images, load_rgb, split_samples

A_JPEG = sorted((SAMPLE / "daisy").glob("*.jpg"))[0]


def write_odd_images(folder) -> dict[str, str]:
    """One file of each awkward kind, made from a real photo; name -> what it is."""
    folder.mkdir(parents=True, exist_ok=True)
    photo = Image.open(A_JPEG).convert("RGB")
    photo.convert("L").save(folder / "gray.png")
    photo.convert("CMYK").save(folder / "cmyk.jpg")
    rgba = photo.convert("RGBA")
    rgba.putalpha(128)
    rgba.save(folder / "alpha.png")
    photo.convert("P", palette=Image.Palette.ADAPTIVE).save(folder / "palette.gif")
    wide = (np.asarray(photo.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    Image.fromarray(wide).save(folder / "sixteen_bit.png")
    photo.save(folder / "UPPER.JPG")
    photo.save(folder / "lossless.webp")
    photo.save(folder / "plain.bmp")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    photo.save(folder / "rotated.jpeg", exif=exif)
    return {
        "gray.png": "L", "cmyk.jpg": "CMYK", "alpha.png": "RGBA", "palette.gif": "P",
        "sixteen_bit.png": "I;16", "UPPER.JPG": "RGB", "lossless.webp": "RGB", "plain.bmp": "RGB",
        "rotated.jpeg": "RGB",
    }


def write_broken_files(folder) -> list[str]:
    """Files with image names that do not decode; their names."""
    data = A_JPEG.read_bytes()
    (folder / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (folder / "not_an_image.jpg").write_text("this is text, not a JPEG")
    (folder / "empty.png").write_bytes(b"")
    return ["truncated.jpg", "not_an_image.jpg", "empty.png"]


def test_every_mode_becomes_rgb(tmp_path):
    modes = write_odd_images(tmp_path)
    for name, mode in modes.items():
        assert Image.open(tmp_path / name).mode == mode, name  # the file really is that kind
        img = load_rgb(str(tmp_path / name))
        assert img.mode == "RGB", name


def test_sixteen_bit_keeps_its_tones(tmp_path):
    write_odd_images(tmp_path)
    gray8 = np.asarray(load_rgb(str(tmp_path / "gray.png")))
    gray16 = np.asarray(load_rgb(str(tmp_path / "sixteen_bit.png")))
    # convert("RGB") on a 16-bit image would clip almost everything to 255.
    assert np.abs(gray8.astype(int) - gray16.astype(int)).max() <= 1


def test_exif_rotation_is_applied(tmp_path):
    write_odd_images(tmp_path)
    w, h = Image.open(A_JPEG).size
    assert load_rgb(str(tmp_path / "rotated.jpeg")).size == (h, w)


def test_draft_decoding_keeps_at_least_the_asked_size(tmp_path):
    big = Image.open(A_JPEG).convert("RGB").resize((1600, 1200))
    big.save(tmp_path / "big.jpg")
    img = load_rgb(str(tmp_path / "big.jpg"), min_size=224)
    assert min(img.size) >= 224 and img.size[0] < 1600  # decoded at reduced scale


def test_unreadable_files_are_found_by_path(tmp_path):
    write_odd_images(tmp_path)
    broken = write_broken_files(tmp_path)
    paths = sorted(str(p) for p in tmp_path.iterdir())
    bad = dict(find_unreadable(paths, threads=2))
    assert sorted(p.rsplit("/", 1)[1] for p in bad) == sorted(broken)


def test_decompression_bomb_is_unreadable(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the photo is far above 2x this
    assert find_unreadable([str(A_JPEG)], threads=1)[0][1].startswith("DecompressionBombError")


def test_listing_skips_hidden_and_non_image_files(tmp_path, capsys):
    copy_sample(tmp_path, classes=["daisy", "roses"], per_class=3)
    (tmp_path / "daisy" / ".hidden.jpg").write_bytes(A_JPEG.read_bytes())
    (tmp_path / "daisy" / "notes.txt").write_text("not an image")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "x.jpg").write_bytes(A_JPEG.read_bytes())
    (tmp_path / "README.md").write_text("top-level files are not classes")
    (tmp_path / "empty_class").mkdir()
    (tmp_path / "no_images").mkdir()
    names, samples = list_images(str(tmp_path))
    assert names == ["daisy", "roses"]
    assert len(samples) == 6 and {label for _, label in samples} == {0, 1}
    assert capsys.readouterr().out == "warning: leaving out folders with no images: empty_class, no_images\n"


def _small_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def test_links_back_up_the_data_folder_are_followed_once(tmp_path):
    """A link to a parent folder, followed blindly, lists the same images without end (a run
    once grew to 24 GB doing so). The listing runs in a child process with 1 GiB of address
    space, so that a regression fails here instead of taking the machine down."""
    data = copy_sample(tmp_path / "data", classes=["daisy", "roses"], per_class=3)
    (data / "daisy" / "loop").symlink_to("..")
    (data / "roses" / "up").symlink_to(data)
    list_and_print = "import json, sys; from utils import list_images; print(json.dumps(list_images(sys.argv[1])))"
    result = subprocess.run([sys.executable, "-c", list_and_print, str(data)], cwd=REPO, capture_output=True,
                            text=True, timeout=60, preexec_fn=_small_address_space,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    warning, listing = result.stdout.splitlines()
    assert warning == f"warning: not following links to folders already listed: {data}/daisy/loop, {data}/roses/up"
    names, samples = json.loads(listing)
    assert names == ["daisy", "roses"]
    assert sorted(path for path, _ in samples) == sorted(str(p) for p in data.glob("*/*.jpg"))


def test_split_is_stratified_deterministic_and_leaves_global_random_alone():
    names, samples = list_images(str(SAMPLE))
    random.seed(123)
    before = random.random()
    random.seed(123)
    a = split_samples(samples, names, 0.2, seed=7)
    assert random.random() == before
    b = split_samples(list(reversed(samples)), names, 0.2, seed=7)
    c = split_samples(samples, names, 0.2, seed=8)
    assert a == b and a != c
    assert len(a.val) == 25 and len(a.train) == 95
    for label in range(5):  # 24 images per class: 5 held out from each
        assert sum(1 for _, lab in a.val if lab == label) == 5
    assert not {p for p, _ in a.val} & {p for p, _ in a.train}


def test_num_classes_mismatch_and_single_class(tmp_path):
    with pytest.raises(UserError, match="--num-classes is 4"):
        list_images(str(SAMPLE), num_classes=4)
    copy_sample(tmp_path, classes=["tulips"], per_class=2)
    with pytest.raises(UserError, match="only one class"):
        list_images(str(tmp_path))


def odd_and_broken_folder(data) -> tuple[dict[str, str], list[str]]:
    """Two classes of six photos, the odd kinds of image added to one, broken files to the other."""
    copy_sample(data, classes=["daisy", "roses"], per_class=6)
    odd = write_odd_images(data / "daisy")
    broken = write_broken_files(data / "roses")
    shutil.copy(A_JPEG, data / "roses" / ".hidden.jpg")
    (data / "roses" / "notes.txt").write_text("ignored")
    return odd, broken


@pytest.mark.slow
def test_training_with_check_images_leaves_out_the_broken_files(tmp_path):
    """--check-images decodes every image at start-up and trains on the odd ones, without the
    broken ones, each named."""
    odd, broken = odd_and_broken_folder(tmp_path / "data")
    data, out = tmp_path / "data", tmp_path / "run"
    result = ok(train_here(out, "--epochs", "1", "--check-images", data=data))
    for name in broken:
        assert f"warning: leaving out {data / 'roses' / name}: " in result.stdout
    record = metrics(out)[0]
    assert record["train_total"] + record["val_total"] == 12 + len(odd)


@pytest.mark.slow
def test_a_file_that_does_not_decode_stops_a_run_without_check_images(tmp_path):
    """By default no image is decoded at start-up: the first broken file the loader draws ends the
    run, exit 1, with the file named and --check-images suggested; the loader workers (default
    count) end with it, nothing is left running, and no epoch was recorded."""
    _, broken = odd_and_broken_folder(tmp_path / "data")
    data, out, marker = tmp_path / "data", tmp_path / "run", uuid.uuid4().hex
    result = train("single", out, "--epochs", "1", data=data, fast=FAST_DEFAULT_WORKERS,
                   env={"TEST_JOB_MARKER": marker}, timeout=60)  # it fails at its first batches, in seconds
    assert result.returncode == 1, result.stderr[-3000:]
    assert "warning: leaving out" not in result.stdout
    named = [name for name in broken if f"cannot decode {data / 'roses' / name}: " in result.stderr]
    assert len(named) == 1, result.stderr[-3000:]
    assert "(--check-images leaves out the files that do not decode)" in result.stderr
    assert "DataLoader worker" in result.stderr  # raised in a worker, handed over to the training process
    assert not processes_with_marker(marker)
    assert not (out / "metrics.jsonl").exists() and not (out / "last.pth").exists()


def test_pixels_stay_uint8_until_the_device_normalises_the_batch():
    """Workers hand over uint8 pixels; `normalize`, run on the batch, gives what torchvision's
    float conversion and Normalize give, in the memory format the batch has."""
    _, samples = list_images(str(SAMPLE))
    dataset = MyDataSet(samples[::30], build_transform(64, train=True), 64, seed=0)
    pixels = torch.stack([dataset[(1, i)][0] for i in range(len(dataset))])
    assert pixels.dtype == torch.uint8 and pixels.shape == (len(dataset), 3, 64, 64)
    expected = v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)(v2.ToDtype(torch.float32, scale=True)(pixels))
    for channels_last, layout in ((False, torch.contiguous_format), (True, torch.channels_last)):  # --channels-last
        batch = model_input(pixels, torch.device("cpu"), channels_last)
        assert batch.dtype == torch.float32 and batch.is_contiguous(memory_format=layout)
        torch.testing.assert_close(batch, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(normalize(pixels), expected, rtol=0, atol=1e-5)
    already = torch.randn(2, 3, 8, 8, dtype=torch.float64)  # synthetic input: taken as it is
    assert model_input(already, torch.device("cpu"), channels_last=False) is already


@pytest.mark.parametrize("device, cores, local_processes, slurm_cpus, expected", [
    ("cuda", 16, 1, None, 15),  # a GPU takes every spare core: it trains faster than 8 cores decode
    ("cuda", 64, 8, None, 7),
    ("cpu", 16, 1, None, 8),  # the CPU step uses every core itself; a few workers keep ahead
    ("cpu", 2, 1, None, 1),
    ("cpu", 2, 2, None, 1),
    ("cuda", 64, 4, "6", 5),  # an srun task: the CPUs SLURM gave it (--cpus-per-task), not its share of the node
])
def test_default_loader_workers(monkeypatch, device, cores, local_processes, slurm_cpus, expected):
    """A process's CPUs (its share of the machine's, or its srun task's), less one for itself."""
    monkeypatch.setattr(distributed_utils, "cpu_count", lambda: cores)  # a machine of `cores` CPUs
    if slurm_cpus:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", slurm_cpus)
    else:
        monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    cpus = cpus_per_process(Ranks(0, 0, local_processes, local_processes, srun_task=slurm_cpus is not None))
    assert my_dataset.default_workers(torch.device(device), cpus) == expected
    if device == "cpu":  # what the launchers' DataLoaders get
        ctx = DistContext(0, 0, local_processes, local_processes, torch.device("cpu"), distributed=False, cpus=cpus)
        assert loader_options(args_for(), ctx)["num_workers"] == expected


def launcher_loaders(args, ctx: DistContext) -> tuple[DataLoader, DataLoader, DistributedSampler]:
    """The training and validation loaders of the sample, built by the launchers' lines."""
    plan = list_images_of(args, "single", verbose=False)
    split = split_samples(plan.samples, plan.class_names, args.val_rate, args.seed, plan.val_files)
    train_set, val_set = train_and_val_sets(split, args)
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                       seed=args.seed)
    options = loader_options(args, ctx)
    train_loader = DataLoader(train_set, sampler=EpochKeys(train_sampler), **options,
                              drop_last=len(train_sampler) > args.batch_size)
    val_loader = DataLoader(val_set, sampler=ShardSampler(len(val_set), ctx), **options)
    return train_loader, val_loader, train_sampler


@pytest.mark.slow
def test_batches_from_workers_are_the_batches_loaded_in_turn():
    """Two persistent workers per loader hand over what the training process itself would have
    loaded, epoch after epoch, a resumed epoch's rest (its first two batches skipped) and the
    validation passes between them included."""
    def passes(workers: str) -> list[list[torch.Tensor]]:
        args = args_for("--workers", workers, "--batch-size", "16", "--img-size", "32")
        train_loader, val_loader, train_sampler = launcher_loaders(args, DistContext.single())
        train_loader.sampler.skip_next_pass(32)  # epoch 1 resumed after two batches, as restore_training does
        seen = []
        for epoch in (1, 2, 3):
            train_sampler.set_epoch(epoch)  # as the launchers' epoch loop does
            seen.append([images for images, _ in train_loader])
            seen.append([images for images, _ in val_loader])
        return seen

    in_turn, from_workers = passes("0"), passes("2")
    assert [len(batches) for batches in in_turn] == [3, 2, 5, 2, 5, 2]
    for theirs, ours in zip(in_turn, from_workers, strict=True):
        assert len(theirs) == len(ours) and all(torch.equal(a, b) for a, b in zip(theirs, ours))
