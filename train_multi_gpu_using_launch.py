"""Train ResNet34 with DistributedDataParallel, one process per GPU, started by torchrun.

    torchrun --nproc_per_node=4 train_multi_gpu_using_launch.py --data-path dataset/flower_photos
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        train_multi_gpu_using_launch.py ...
    srun python train_multi_gpu_using_launch.py ...      # SLURM, one task per GPU
    torchrun --nproc_per_node=4 train_multi_gpu_using_launch.py ... --check   # diagnose, do not train

Rank, local rank and world size come from the environment that torchrun, the legacy
`python -m torch.distributed.launch` or SLURM sets. Run without any of them, it trains in
one process. `--help` lists every option and docs/options.md says what each does; all three
launchers share them.

Every process runs this file from the top, on its own share of the images. The rule of
collectives: every rank makes the same collectives (all_reduce, broadcast, gather, barrier) in
the same order, and none under `if rank == 0:`; a rank that skips one leaves the others
waiting in it. The comment of each line below that makes one, or leads to one, says which.
Rank 0 alone prints and writes. docs/how-it-works.md says why each call is where it is.
"""
import signal
import sys
import time
from contextlib import nullcontext

# Loading torch and the rest takes seconds: a SIGTERM meanwhile (a job preempted as it starts)
# ends this process with 75, as one anywhere outside training does, for the scheduler to requeue it.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(75))

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from model import cpu_sync_batchnorm
from multi_train_utils.check import check
from multi_train_utils.config import read_command_line
from multi_train_utils.distributed_utils import init_distributed
from multi_train_utils.faults import handling_sigterm_and_faults
from multi_train_utils.loaders import build_datasets
from multi_train_utils.preemption import exit_75_on_sigterm
from multi_train_utils.report import write_report
from multi_train_utils.resume import restore_training
from multi_train_utils.run_folder import RunFiles, open_run_folder
from multi_train_utils.train_eval_utils import build_model, build_optimizer, evaluate_epoch, train_one_epoch
from utils import exit_on_error


@record  # torchrun's failure summary then shows each failed process's own error
def main() -> None:
    with exit_on_error():
        exit_75_on_sigterm()  # a SIGTERM before training: exit 75 (requeue me); during it: a stop at a step
        plan = read_command_line("launch", __doc__)  # checked, images listed, torchrun's (or srun's) ranks read
        args = plan.args
        if args.check:  # diagnose instead of training
            sys.exit(check(plan, plan.rendezvous))  # its own rendezvous, then an all_gather and all_reduces
        # dist.init_process_group: NCCL on GPUs, gloo on the CPU, each process on its local rank's GPU
        # (none without torchrun or srun: one process).
        ctx = init_distributed(plan.rendezvous, args.device, args.backend, args.dist_timeout)
        try:
            train(plan, ctx)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def train(plan, ctx) -> None:
    """The whole run of one process: `plan` is the checked command line and the images, `ctx`
    this process's rank, device and whether a process group exists."""
    args = plan.args
    began = time.perf_counter()
    # broadcast: rank 0 creates the run folder and finds --resume auto's checkpoint; every rank reads that file.
    output_dir, checkpoint = open_run_folder(plan, ctx)
    with handling_sigterm_and_faults(output_dir, ctx) as sigterm:  # SIGTERM a request; a lost peer named
        # all_gather: the unreadable files each rank found, so all split alike (a barrier with --cache,
        # an all_reduce with --device-augment).
        data = build_datasets(plan, checkpoint, ctx)
        # Each rank draws its own 1/world_size of the training images, in a new order every epoch.
        train_sampler = DistributedSampler(data.train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                           seed=args.seed)
        train_loader, val_loader = data.loaders(train_sampler, args, ctx)  # validation: unpadded shards

        model = build_model(args, len(data.class_names), ctx)  # seeded: the same initial weights on every rank
        if args.eval_only:
            # all_reduce and all_gather: the weights --resume or --weights gives, evaluated; their report.
            write_report(model, val_loader, data, output_dir, args, ctx, checkpoint=checkpoint)
            return
        if checkpoint:
            model.load_state_dict(checkpoint["model"])
        if args.sync_bn and ctx.distributed:
            # BatchNorm statistics over the global batch, not each rank's share: swapped in before the wrap.
            if ctx.device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            else:
                model = cpu_sync_batchnorm(model)  # torch's runs on GPUs only: the same sums, over gloo
        model_without_ddp = model  # what is saved, evaluated and averaged: its weights load under any launcher
        if ctx.distributed:
            # broadcast: DDP copies rank 0's weights to every rank now; backward() all-reduces the gradients.
            model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        if args.compile:
            model = torch.compile(model)
        # After the swap and the wrap: over the parameters the model has now. The learning rate, set at every
        # step, peaks at --lr x global batch / 256: more processes, a larger global batch, a higher rate.
        optimizer, scaler, ema = build_optimizer(model_without_ddp, args, ctx.device)  # ema: --ema's average
        criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
        # --resume: every rank restores the same optimizer state; a stopped epoch goes on after its last step.
        progress = restore_training(checkpoint, optimizer, scaler, ema, train_loader, data.lost_files, args, ctx)

        best = None
        files = RunFiles(output_dir, plan, data.split, data.root, progress, model_without_ddp, optimizer, scaler, ema,
                         ctx, began) if ctx.is_main else None  # rank 0's files, written beside the training
        with files or nullcontext():
            for epoch in range(progress.epoch + 1, progress.last_epoch + 1):
                # broadcast: under --time-budget, rank 0's clock decides for every rank whether this epoch runs.
                if args.time_budget and progress.out_of_time(epoch, args, train_loader, output_dir, ctx):
                    break
                train_sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
                # all_reduce: DDP's of the gradients in every backward(), a small one every 20 steps (a NaN
                # loss or a SIGTERM on any rank stops them all), and the epoch's loss and accuracy.
                train_stats = train_one_epoch(model, criterion, optimizer, scaler, train_loader, epoch, progress,
                                              args, ctx, ema, sigterm)
                if train_stats["stopped_after"]:  # SIGTERM: every rank stopped after the same step
                    sigterm.save_position_and_exit(files, epoch, progress, train_stats)  # barrier, then exit 75
                # broadcast of rank 0's BatchNorm statistics, then all_reduce: exact, every image once.
                evaluated = evaluate_epoch(model_without_ddp, val_loader, args, ctx, ema, data.recalibrate)
                is_best = evaluated.acc > progress.best_acc
                if is_best:
                    best = (epoch, evaluated)
                progress.finish_epoch(epoch, evaluated.acc, train_stats, evaluated.seconds)
                if ctx.is_main:  # rank 0 alone saves; the others go on to their next collective
                    files.save_epoch(epoch, progress, train_stats, evaluated, is_best)
            # all_reduce and all_gather: best.pth's report, from the outputs its epoch kept (a broadcast if it reloads).
            write_report(model_without_ddp, val_loader, data, output_dir, args, ctx, best=best)


if __name__ == "__main__":
    main()
