"""How each process gets its data: the readable split, the shared-memory image cache, the
training images on the device (--device-augment), and the training and validation loaders with
their distributed samplers."""
from __future__ import annotations

import argparse
import dataclasses
import mmap
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.transforms.v2.functional import resize

from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import (
    DistContext,
    ShardSampler,
    all_reduce_sum,
    barrier,
    broadcast_object,
    die_with_parent,
    gather_objects,
)
from my_dataset import (
    CropDraws,
    DeviceCrops,
    EpochSampler,
    MyDataSet,
    PixelCache,
    SizeSchedule,
    build_transform,
    cache_short_side,
    decode,
    default_workers,
    eval_img_size,
    eval_resize,
    size_schedule,
    train_transforms,
)
from utils import (
    SPLIT_FILE,
    DataSplit,
    RecordedSplit,
    Sample,
    UserError,
    cpu_count,
    drop_unreadable,
    file_stamp,
    find_unreadable,
    load_recorded_split,
    load_rgb,
    split_samples,
)


@dataclasses.dataclass(frozen=True)
class RunData:
    """The files a run trains and evaluates on, fixed when it started."""

    split: DataSplit
    root: str  # the folder they are under, recorded with them
    lost_files: bool = False  # a resumed run goes on without recorded files: a position inside an epoch no longer holds


def run_data(plan: Plan, resume_path: str | None, ctx: DistContext) -> RunData:
    """A new run's split of the folder (readable_split). A resumed run's is the one its
    split.json recorded, beside the checkpoint: the folder is not split again, whatever was
    added to it or removed since, and the files are not decoded again, only compared with their
    recorded size and time (recorded_files). Rank 0 reads and checks; every rank gets its verdict."""
    recorded = Path(resume_path).parent / SPLIT_FILE if resume_path and not plan.args.eval_only else None
    if recorded is None or not recorded.is_file():
        if recorded is not None:
            ctx.print0(f"warning: {recorded} does not exist (a run folder from before runs recorded their files): "
                       f"{plan.args.data_path} is listed and split again, and files added or removed since the run "
                       "started change its split")
        return RunData(readable_split(plan, ctx), plan.args.data_path)
    verdict = broadcast_object(_recorded_or_error(plan, recorded) if ctx.is_main else None, ctx)
    if isinstance(verdict, str):
        raise UserError(verdict)
    data, lines = verdict
    for line in lines:
        ctx.print0(line)
    return data


def _recorded_or_error(plan: Plan, recorded: Path) -> tuple[RunData, list[str]] | str:
    try:
        return recorded_files(plan, load_recorded_split(recorded), recorded)
    except UserError as e:
        return str(e)


def recorded_files(plan: Plan, record: RecordedSplit, source: Path) -> tuple[RunData, list[str]]:
    """The recorded split, checked: every file still there with its recorded size and time
    (a changed one must still decode), and what to say about it. Files gone or unreadable are
    an error, or with --drop-missing left out; files added to the folder since are not used."""
    args, split, lines = plan.args, record.split, []
    root = record.data_path or args.data_path
    if args.data_moved:
        split = _moved(split, root, args.data_path)
        lines.append(f"{source}: the run's files are read under {args.data_path}, where they moved from {root}")
        root = args.data_path
    moved_hint = ""
    if not args.data_moved and os.path.abspath(args.data_path) != os.path.abspath(root):
        moved_hint = f"; if they moved to {args.data_path}, add --data-moved"
        lines.append(f"{source}: the run's files under {root} are used, not --data-path {args.data_path} "
                     "(if they moved there, add --data-moved)")
    files = [p for p, _ in split.train + split.val]
    stamps = record.stamps or [None] * len(files)
    now = [file_stamp(p) for p in files]
    gone = [p for p, stamp in zip(files, now) if stamp is None]
    changed = [p for p, then, stamp in zip(files, stamps, now) if then is not None and stamp not in (None, then)]
    bad = gone + [p for p, _ in find_unreadable(changed, threads=cpu_count())]
    if bad and not args.drop_missing:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise UserError(f"{len(bad)} of the run's {len(files)} files are gone or no longer decode ({shown}); "
                        f"{source} is the run's split: restore them, or resume with --drop-missing to go on without "
                        f"them{moved_hint}")
    if bad:
        left_out = set(bad)
        split = DataSplit(split.class_names, [s for s in split.train if s[0] not in left_out],
                          [s for s in split.val if s[0] not in left_out])
        lines.append(f"--drop-missing: left out {len(record.split.train) - len(split.train)} training and "
                     f"{len(record.split.val) - len(split.val)} validation image(s) that are gone or no longer decode")
    same_folder = os.path.abspath(root) == os.path.abspath(args.data_path)
    new = len({os.path.abspath(p) for p, _ in plan.samples} - {os.path.abspath(p) for p in files}) if same_folder else 0
    if new:
        lines.append(f"{new} image(s) added to {args.data_path} since the run started are not used: to train on them, "
                     "start a new run (another --output-dir, without --resume)")
    return RunData(split, root, lost_files=bool(bad)), lines


def _moved(split: DataSplit, old_root: str, new_root: str) -> DataSplit:
    """The split's files, each at the same place under `new_root` as it was under `old_root`."""
    def move(samples: list[Sample]) -> list[Sample]:
        return [(os.path.join(new_root, os.path.relpath(p, old_root)), label) for p, label in samples]

    return DataSplit(split.class_names, move(split.train), move(split.val))


def readable_split(plan: Plan, ctx: DistContext) -> DataSplit:
    """Leave out files that do not decode, then split. Each rank decodes 1/world_size of the
    files, with the threads of its share of the machine, and the ranks swap their findings, so
    every rank ends with the same split."""
    paths = [p for p, _ in plan.samples]
    mine = find_unreadable(paths[ctx.rank :: ctx.world_size], threads=max(1, cpu_count() // ctx.local_world_size))
    unreadable = dict(pair for part in gather_objects(mine, ctx) for pair in part)
    for path, reason in sorted(unreadable.items()):
        ctx.print0(f"warning: leaving out {path}: {reason}")
    samples = drop_unreadable(plan.samples, plan.class_names, unreadable)
    return split_samples(samples, plan.class_names, plan.args.val_rate, plan.args.seed)


def start_worker(_worker_id: int) -> None:
    """Set up a loader worker: it ends with its training process (sooner than PyTorch's
    watchdog would notice), and drops no traceback about a handover cut short."""
    die_with_parent()
    sys.excepthook = quiet_dropped_handover(sys.excepthook)


def quiet_dropped_handover(hook: Callable[..., None]) -> Callable[..., None]:
    """`hook`, silent about a dropped connection. A batch leaves a worker as shared-memory file
    descriptors, handed over a socket by a thread of the worker (multiprocessing's
    resource_sharer) that reports any failure through sys.excepthook. A training process ended
    by Ctrl-C in the middle of a handover drops that socket, and the report would be a traceback
    under the run's own "interrupted" line, about nothing the user could act on."""

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not issubclass(kind, (ConnectionError, EOFError)):
            hook(kind, value, tb)

    return excepthook


def build_loaders(split: DataSplit, plan: Plan, ctx: DistContext) -> tuple[DataLoader | DeviceAugmentedLoader, DataLoader]:
    """The training loader (a DeviceAugmentedLoader under --device-augment) and the validation loader."""
    args = plan.args
    on_device = args.device_augment and not args.eval_only
    workers = default_workers(ctx.device, ctx.local_world_size) if args.workers is None else args.workers
    common = dict(
        batch_size=args.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=start_worker,
        pin_memory=ctx.device.type == "cuda",
        # A process started by mp.spawn would also spawn its loader workers, each re-importing
        # torch (seconds) and receiving a pickled copy of the dataset; forking, Linux's default
        # everywhere else, shares the parent's memory, the --cache pixels included.
        multiprocessing_context="fork" if workers > 0 and sys.platform == "linux" else None,
    )
    val_size = eval_img_size(vars(args))
    cache = None
    if args.cache:
        started = time.perf_counter()
        cache = SharedImageCache([p for p, _ in split.train + split.val],
                                 cache_short_side(vars(args)), ctx)
        ctx.print0(f"cache: {len(cache.shapes)} images, {cache.nbytes / 2**20:.0f} MiB of shared memory, one copy "
                   f"for the {ctx.local_world_size} process(es) on this machine, filled in "
                   f"{time.perf_counter() - started:.1f}s")
    if on_device:
        crops = device_crops(split, eval_resize(args.img_size), ctx, cache)
        train_set = CropDraws(split.train, crops.frames.tolist(), args.seed, args.crop_scale, args.flip)
    else:
        train_set = MyDataSet(split.train, train_transforms(vars(args)), args.img_size, args.seed, cache)
    val_set = MyDataSet(split.val, build_transform(val_size, train=False), eval_resize(val_size), cache=cache)
    # Every process, the single one included, draws from a DistributedSampler: one code path.
    train_sampler = EpochSampler(
        DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    )
    # A last batch of one image breaks BatchNorm in training mode; drop the remainder instead
    # (the shuffle changes which images fall in it every epoch).
    drop_last = len(train_sampler) > args.batch_size
    train_loader = DataLoader(train_set, sampler=train_sampler, drop_last=drop_last, **common)
    val_loader = DataLoader(val_set, sampler=ShardSampler(len(val_set), ctx), **common)
    if on_device:
        return DeviceAugmentedLoader(train_loader, crops, size_schedule(vars(args))), val_loader
    return train_loader, val_loader


def recalibration_batches(split: DataSplit, args: argparse.Namespace) -> list[torch.Tensor]:
    """--bn-recalibrate's images: N training images spread evenly over the split (every class
    in its share), prepared as validation images are, in batches of --batch-size; uint8, a
    few MiB. The same on every rank."""
    n = min(args.bn_recalibrate, len(split.train))
    size = eval_img_size(vars(args))
    chosen = MyDataSet([split.train[i * len(split.train) // n] for i in range(n)],
                       build_transform(size, train=False), eval_resize(size))
    images = torch.stack([chosen[i][0] for i in range(n)])
    return list(images.split(args.batch_size))


class DeviceAugmentedLoader:
    """The training loader of --device-augment: its workers draw each image's crop and flip
    (CropDraws), and each batch is cut from the pixels on the device, all images in one call
    (DeviceCrops), at the epoch's size. Iterated, sized and set to an epoch like a DataLoader;
    its batches are normalised float images already on the device."""

    def __init__(self, draws: DataLoader, crops: DeviceCrops, sizes: SizeSchedule):
        self.draws = draws
        self.crops = crops
        self.sizes = sizes
        self.sampler: EpochSampler = draws.sampler

    def __len__(self) -> int:
        return len(self.draws)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        size = (self.sampler.sizes or self.sizes)(self.sampler.epoch or 1)
        draws = iter(self.draws)  # now, not at the first batch: the workers start drawing at once
        return ((self.crops(batch, size), labels) for batch, labels in draws)


class StartedPass:
    """One pass over a loader, begun when made: a DataLoader's iterator hands its workers the
    first batches' indices at once (persistent workers are kept and given the new pass).
    `then` is called as the last batch is handed over, to begin another pass while the last
    step computes."""

    def __init__(self, loader: DataLoader | DeviceAugmentedLoader, then: Callable[[], None] | None = None):
        self.sampler = loader.sampler
        self._length = len(loader)
        self._batches = iter(loader)
        self._then = then

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for number, batch in enumerate(self._batches, start=1):
            if number == self._length and self._then is not None:
                self._then()
            yield batch


class EpochPasses:
    """The training and validation passes of each epoch, each begun ahead of its use: the next
    epoch's training batches load while the model evaluates, and with `val_ahead` the
    validation batches while the last training steps run. What a batch holds depends on (seed,
    epoch, index) alone (docs/exactness.md), never on when it was loaded."""

    def __init__(self, train_loader: DataLoader | DeviceAugmentedLoader, val_loader: DataLoader, val_ahead: bool):
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.val_ahead = val_ahead
        self._ahead: tuple[int, StartedPass] | None = None  # (epoch, its training pass)
        self._val: StartedPass | None = None

    def train(self, epoch: int, skip: int = 0) -> StartedPass:
        """Epoch `epoch`'s training pass after its first `skip` samples: begun ahead, or now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == epoch and skip == 0:
            return ahead[1]
        self.train_loader.sampler.set_epoch(epoch, skip=skip)
        return self._train_pass()

    def begin_train(self, epoch: int) -> None:
        """Begin epoch `epoch`'s training pass now (its crop sizes must be fixed by then)."""
        self.train_loader.sampler.set_epoch(epoch)
        self._ahead = epoch, self._train_pass()

    def _train_pass(self) -> StartedPass:
        return StartedPass(self.train_loader, then=self.begin_val if self.val_ahead else None)

    def begin_val(self) -> None:
        """Begin the validation pass now, unless one is begun already."""
        if self._val is None:
            self._val = StartedPass(self.val_loader)

    def val(self) -> StartedPass:
        """A validation pass: the one begun before, or a new one."""
        begun, self._val = self._val, None
        return begun or StartedPass(self.val_loader)


def device_crops(split: DataSplit, side: int, ctx: DistContext, cache: PixelCache | None) -> DeviceCrops:
    """The training images as DeviceCrops: each `side` px square, on this process's device.
    Each process decodes 1/world_size of them (and reads their frames), the others' places left
    at zero, and a sum over the processes fills in the rest: every process ends with the same
    pixels, each decoded once."""
    started = time.perf_counter()
    paths = [p for p, _ in split.train]
    nbytes = len(paths) * 3 * side * side
    check_device_room(nbytes, ctx)
    pixels = torch.zeros(len(paths), 3, side, side, dtype=torch.uint8)
    frames = torch.zeros(len(paths), 2, dtype=torch.int64)

    def fill(i: int) -> None:
        try:
            picture = cache.get(paths[i]) if cache is not None else decode(paths[i], side)
        except Exception as e:  # unreadable files were left out at start-up; this one changed since
            raise RuntimeError(f"cannot decode {paths[i]}: {e}") from e
        pixels[i] = resize(picture, [side, side], antialias=True)
        frames[i] = torch.tensor(_picture_shape(paths[i], side))  # the frame --cache's pixels have

    with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:  # decoding releases the GIL
        list(pool.map(fill, range(ctx.rank, len(paths), ctx.world_size)))
    # One process filled each image's place, the others left it 0: the sums are the images.
    pixels = all_reduce_sum(pixels.to(ctx.device), ctx)
    frames = all_reduce_sum(frames.to(ctx.device), ctx)
    ctx.print0(f"device augment: {len(paths)} training images, {nbytes / 2**20:.0f} MiB on {ctx.device} per "
               f"process, decoded in {time.perf_counter() - started:.1f}s")
    return DeviceCrops(pixels, frames)


def check_device_room(nbytes: int, ctx: DistContext) -> None:
    free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.device.type == "cuda" else memory_available()
    problem = (
        f"--device-augment keeps the training images on {ctx.device}: {nbytes / 2**30:.2f} GiB, but only "
        f"{free / 2**30:.2f} GiB is free: train without it, or with a smaller --img-size"
    )
    # The rest is the model's, its activations' and the batch's.
    raise_together(problem if nbytes > 0.5 * free else None, ctx)


class SharedImageCache:
    """Every image decoded once, resized to a short side of `short_side`, kept as uint8 RGB in
    one shared-memory file per machine.

    Local rank 0 creates the file in /dev/shm, every process on the machine maps it, and the
    name is removed before the (slow) decoding starts: the memory lives exactly as long as the
    processes mapping it, so a crash leaves nothing behind. Data-loader workers inherit the
    mapping when they fork, so there is one copy per machine, not one per rank or per worker.
    """

    def __init__(self, paths: Sequence[str], short_side: int, ctx: DistContext):
        if sys.platform != "linux":
            raise UserError("--cache needs Linux (a /dev/shm file shared with forked loader workers)")
        self.index = {p: i for i, p in enumerate(paths)}
        self.shapes = [_picture_shape(p, short_side) for p in paths]  # header reads only
        sizes = [h * w * 3 for h, w in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.nbytes = int(self.offsets[-1])
        check_cache_room(self.nbytes, ctx)
        token = broadcast_object(secrets.token_hex(8) if ctx.is_main else None, ctx)
        path = f"/dev/shm/imgcache-{token}-{ctx.rank - ctx.local_rank}"  # one per machine, even two "machines" on one
        creator = ctx.local_rank == 0
        if creator:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, max(1, self.nbytes))
        barrier(ctx)
        if not creator:
            fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(fd, max(1, self.nbytes))
        os.close(fd)
        barrier(ctx)
        if creator:
            os.unlink(path)
        self.pixels = np.frombuffer(self._map, dtype=np.uint8, count=self.nbytes)
        mine = range(ctx.local_rank, len(paths), ctx.local_world_size)
        with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:  # PIL releases the GIL
            list(pool.map(lambda i: self._fill(i, paths[i], short_side), mine))
        barrier(ctx)

    def _fill(self, i: int, path: str, short_side: int) -> None:
        h, w = self.shapes[i]
        img = load_rgb(path, min_size=short_side).resize((w, h), Image.BILINEAR, reducing_gap=3.0)
        self.pixels[self.offsets[i] : self.offsets[i + 1]] = np.asarray(img).reshape(-1)

    def get(self, path: str) -> torch.Tensor:
        """The cached picture as a uint8 CHW tensor viewing the shared memory (no copy)."""
        i = self.index[path]
        h, w = self.shapes[i]
        hwc = self.pixels[self.offsets[i] : self.offsets[i + 1]].reshape(h, w, 3)
        return torch.from_numpy(hwc).permute(2, 0, 1)


def _picture_shape(path: str, short_side: int) -> tuple[int, int]:
    """(height, width) of the upright picture, resized to a short side of `short_side`."""
    with Image.open(path) as img:
        w, h = img.size
        if img.getexif().get(0x0112) in (5, 6, 7, 8):  # EXIF says: rotated by 90 degrees
            w, h = h, w
    scale = short_side / min(w, h)
    return max(1, round(h * scale)), max(1, round(w * scale))


def check_cache_room(nbytes: int, ctx: DistContext) -> None:
    raise_together(cache_problem(nbytes, shutil.disk_usage("/dev/shm").free, memory_available()), ctx)


def cache_problem(nbytes: int, shm_free: int, available: int) -> str | None:
    """Why a cache of `nbytes` does not fit a machine with this much free /dev/shm and RAM, or None."""
    room = min(shm_free, available)
    if nbytes <= 0.8 * room:  # leave room for the model, the loaders and the rest of the machine
        return None
    return (f"--cache needs {nbytes / 2**30:.2f} GiB of shared memory, but only {room / 2**30:.2f} GiB is "
            "available (/dev/shm or free RAM): train without --cache, or with a smaller --img-size")


def raise_together(problem: str | None, ctx: DistContext) -> None:
    """Raise `problem` on every rank as soon as one rank has it. Machines differ in
    free memory: a rank that raised alone would leave the others waiting in their next collective
    until --dist-timeout. Costs one gather, so the ranks agree before they part."""
    found = gather_objects((socket.gethostname(), problem) if problem else None, ctx)
    failing = [(rank, entry) for rank, entry in enumerate(found) if entry]
    if not failing:
        return
    rank, (host, first) = failing[0]
    where = f"rank {rank} on {host}" + (f" (and {len(failing) - 1} other rank(s))" if len(failing) > 1 else "")
    raise UserError(f"{where}: {first}" if ctx.distributed else first)


def memory_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
