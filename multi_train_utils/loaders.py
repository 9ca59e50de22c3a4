"""How each process gets its data: the readable split (or a resumed run's recorded one), the
datasets, and the loaders around them: the training loader draws from the DistributedSampler
the launcher makes, the validation loader from an unpadded shard of each rank's own."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from multi_train_utils.checkpoint import check_classes
from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import (
    DistContext,
    ShardSampler,
    broadcast_object,
    keep_inherited_objects,
    gather_objects,
    prepare_helper_start,
)
from my_dataset import (
    CropDraws,
    DeviceCrops,
    EpochKeys,
    MyDataSet,
    build_transform,
    default_workers,
    eval_img_size,
    eval_resize,
    size_schedule,
    train_transforms,
)
from processes.helper_signals import die_with_parent, leave_sigterm_to
from recipe.recalibrate import BatchNormRecalibration, recalibration
from speed.device_augment import DeviceAugmentedLoader, device_crops
from speed.gpu_decode import DeviceBatches, validation_on_device
from speed.image_cache import shared_cache
from utils import (
    SPLIT_FILE,
    DataSplit,
    RecordedSplit,
    Sample,
    UserError,
    cores_per_process,
    cpu_count,
    drop_unreadable,
    file_stamp,
    find_unreadable,
    load_recorded_split,
    split_samples,
)


@dataclasses.dataclass(frozen=True)
class RunData:
    """The files a run trains and evaluates on, fixed when it started, and their datasets."""

    split: DataSplit
    root: str  # the folder they are under, recorded with them
    train_set: MyDataSet | CropDraws
    val_set: MyDataSet
    lost_files: bool = False  # a resumed run goes on without recorded files: a position inside an epoch no longer holds
    crops: DeviceCrops | None = None  # --device-augment: the training pictures on the device
    recalibrate: BatchNormRecalibration | None = None  # --bn-recalibrate: its images, prepared on first use

    @property
    def class_names(self) -> list[str]:
        return self.split.class_names

    def loaders(self, train_sampler: DistributedSampler, args: argparse.Namespace,
                ctx: DistContext) -> tuple[DataLoader | DeviceAugmentedLoader, DataLoader | DeviceBatches]:
        """The training loader, drawing from `train_sampler` (a DistributedSampler: each rank its own
        1/world_size of the training images, reshuffled every epoch by its set_epoch), each index
        with its epoch (EpochKeys); under --device-augment, a DeviceAugmentedLoader. And the
        validation loader, each rank a disjoint shard without padding, so that every image is
        evaluated exactly once."""
        workers = default_workers(ctx.device, ctx.local_world_size) if args.workers is None else args.workers
        common = dict(
            batch_size=args.batch_size,
            num_workers=workers,
            persistent_workers=workers > 0,
            worker_init_fn=functools.partial(start_worker, os.getpid()),
            pin_memory=ctx.device.type == "cuda",
            # A process started by mp.spawn would also spawn its loader workers, each re-importing
            # torch (seconds) and receiving a pickled copy of the dataset; forking, Linux's default
            # everywhere else, shares the parent's memory, the --cache pixels included, except
            # where a fork could hang (prepare_helper_start).
            multiprocessing_context=prepare_helper_start(ctx) if workers > 0 and sys.platform == "linux" else None,
        )
        keys = EpochKeys(train_sampler)
        # A last batch of one image breaks BatchNorm in training mode; drop the remainder instead
        # (the shuffle changes which images fall in it every epoch).
        train_loader = DataLoader(self.train_set, sampler=keys, drop_last=len(keys) > args.batch_size, **common)
        val_loader = DataLoader(self.val_set, sampler=ShardSampler(len(self.val_set), ctx), **common)
        if self.crops is not None:
            if ctx.device.type == "cuda":  # the validation images decoded once, by nvJPEG, and kept on the GPU
                val_loader = validation_on_device(self.val_set, val_loader.sampler, args.batch_size, ctx,
                                                  cores_per_process(ctx.local_world_size))
            return DeviceAugmentedLoader(train_loader, self.crops, size_schedule(vars(args))), val_loader
        return train_loader, val_loader


def build_datasets(plan: Plan, checkpoint: dict[str, Any] | None, ctx: DistContext) -> RunData:
    """The run's split and its training and validation datasets. A new run's split of the
    folder (readable_split); a resumed run's, and --eval-only's of a run's checkpoint, is the one
    its split.json recorded, beside the checkpoint: the folder is not split again, whatever was
    added to it or removed since, and the files are not decoded again, only compared with their
    recorded size and time (recorded_files). Collectives: an all_gather of the unreadable files
    each rank found (a new run) or, resumed, a broadcast of whether rank 0 sees the record, then
    of rank 0's verdict on the recorded files (an all_gather where it has none); with --cache,
    a broadcast and barriers; with --device-augment, two all_reduces that fill in the pixels."""
    args = plan.args
    path = checkpoint["loaded_from"] if checkpoint is not None else None
    root, lost_files = args.data_path, False
    recorded = Path(path).parent / SPLIT_FILE if path else None  # --eval-only too: the run's validation images
    # broadcast: rank 0's view of the folder decides which collective every rank makes next (a
    # node-local copy of a run folder, or a lagging network file system, may show each rank another).
    if recorded is None or not broadcast_object(recorded.is_file() if ctx.is_main else None, ctx):
        if recorded is not None:
            ctx.print0(f"warning: {recorded} does not exist (a run folder from before runs recorded their files): "
                       f"{args.data_path} is listed and split again, and files added or removed since the run "
                       "started change its split")
        split = readable_split(plan, ctx)  # all_gather: the files each rank could not read
    else:
        verdict = broadcast_object(_recorded_or_error(plan, recorded) if ctx.is_main else None, ctx)
        if isinstance(verdict, str):
            raise UserError(verdict)
        (split, root, lost_files), lines = verdict
        for line in lines:
            ctx.print0(line)
    ctx.print0(split_summary(split))
    if checkpoint is not None:
        check_classes(checkpoint, split.class_names, path)
    # --cache: an all_gather, a broadcast, 3 barriers; --device-augment: an all_gather, 2 all_reduces.
    train_set, val_set, crops = datasets_of(split, plan, ctx)
    return RunData(split, root, train_set, val_set, lost_files, crops, recalibration(split, args))


def split_summary(split: DataSplit) -> str:
    return (
        f"{len(split.train) + len(split.val)} images in {len(split.class_names)} classes "
        f"({', '.join(split.class_names)}): {len(split.train)} for training, {len(split.val)} for validation"
        + (" (the folder's own split)" if split.given else "")
    )


def _recorded_or_error(plan: Plan, recorded: Path) -> tuple[tuple[DataSplit, str, bool], list[str]] | str:
    try:
        return recorded_files(plan, load_recorded_split(recorded), recorded)
    except UserError as e:
        return str(e)


def recorded_files(plan: Plan, record: RecordedSplit, source: Path) -> tuple[tuple[DataSplit, str, bool], list[str]]:
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
        split = dataclasses.replace(split, train=[s for s in split.train if s[0] not in left_out],
                                    val=[s for s in split.val if s[0] not in left_out])
        lines.append(f"--drop-missing: left out {len(record.split.train) - len(split.train)} training and "
                     f"{len(record.split.val) - len(split.val)} validation image(s) that are gone or no longer decode")
    same_folder = os.path.abspath(root) == os.path.abspath(args.data_path)
    new = len({os.path.abspath(p) for p, _ in plan.samples} - {os.path.abspath(p) for p in files}) if same_folder else 0
    if new:
        lines.append(f"{new} image(s) added to {args.data_path} since the run started are not used: to train on them, "
                     "start a new run (another --output-dir, without --resume)")
    return (split, root, bool(bad)), lines


def _moved(split: DataSplit, old_root: str, new_root: str) -> DataSplit:
    """The split's files, each at the same place under `new_root` as it was under `old_root`."""
    def move(samples: list[Sample]) -> list[Sample]:
        return [(os.path.join(new_root, os.path.relpath(p, old_root)), label) for p, label in samples]

    return dataclasses.replace(split, train=move(split.train), val=move(split.val))


def readable_split(plan: Plan, ctx: DistContext) -> DataSplit:
    """Leave out files that do not decode, then split. Each rank decodes 1/world_size of the
    files, with the threads of its share of the machine, and the ranks swap their findings, so
    every rank ends with the same split."""
    paths = [p for p, _ in plan.samples]
    mine = find_unreadable(paths[ctx.rank :: ctx.world_size], threads=cores_per_process(ctx.local_world_size))
    unreadable = dict(pair for part in gather_objects(mine, ctx) for pair in part)
    for path, reason in sorted(unreadable.items()):
        ctx.print0(f"warning: leaving out {path}: {reason}")
    samples = drop_unreadable(plan.samples, plan.class_names, unreadable)
    if plan.val_files is not None:  # the folder's own train/ and val/
        return DataSplit(plan.class_names, [s for s in samples if s[0] not in plan.val_files],
                         [s for s in samples if s[0] in plan.val_files], given=True)
    return split_samples(samples, plan.class_names, plan.args.val_rate, plan.args.seed)


def start_worker(trainer: int, _worker_id: int) -> None:
    """Set up a loader worker of the training process `trainer`: it ends with that process
    (sooner than PyTorch's watchdog would notice), leaves a SIGTERM sent to the whole job to it
    and ends on one from it, and drops no traceback about a handover cut short."""
    die_with_parent()
    leave_sigterm_to(trainer)  # in place of torch's handler, set before this runs
    keep_inherited_objects()
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


def datasets_of(split: DataSplit, plan: Plan, ctx: DistContext) -> tuple[MyDataSet | CropDraws, MyDataSet,
                                                                         DeviceCrops | None]:
    """The training and validation datasets of `split` (under --device-augment the training
    set draws crops of pictures that wait on the device, in the DeviceCrops returned too)."""
    args = plan.args
    val_size = eval_img_size(vars(args))
    cache = shared_cache(split, vars(args), ctx) if args.cache else None
    crops = None
    if args.device_augment and not args.eval_only:
        crops = device_crops(split, eval_resize(args.img_size), ctx, cache)
        train_set = CropDraws(split.train, crops.frames.tolist(), args.seed, args.crop_scale, args.flip)
    else:
        train_set = MyDataSet(split.train, train_transforms(vars(args)), args.img_size, args.seed, cache)
    val_set = MyDataSet(split.val, build_transform(val_size, train=False), eval_resize(val_size), cache=cache)
    return train_set, val_set, crops


def loaders_of(split: DataSplit, plan: Plan, ctx: DistContext) -> tuple[DataLoader | DeviceAugmentedLoader, DataLoader,
                                                                        DistributedSampler]:
    """The training and validation loaders of `split`, and the training loader's DistributedSampler,
    made as the launchers make them, for the benchmarks, --check and the tests."""
    train_set, val_set, crops = datasets_of(split, plan, ctx)
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=plan.args.seed)
    data = RunData(split, plan.args.data_path, train_set, val_set, crops=crops)
    return (*data.loaders(sampler, plan.args, ctx), sampler)
