"""Train ResNet34 with DistributedDataParallel, processes started by torch.multiprocessing.spawn.

    python train_multi_gpu_using_spawn.py --data-path dataset/flower_photos          # one per GPU
    python train_multi_gpu_using_spawn.py --world-size 2 --data-path data/flower_photos_sample

No launcher needed: this script starts the processes itself, on this machine only, and picks a
free port on 127.0.0.1 unless MASTER_ADDR/MASTER_PORT are set. On a machine without GPUs,
--world-size N runs N CPU processes with gloo. `--help` lists every option and docs/options.md
says what each does.

main() starts the processes; each runs worker() and then train(), on its own share of the
images. The rule of collectives: every rank makes the same collectives (all_reduce, broadcast,
gather, barrier) in the same order, and none under `if rank == 0:`; a rank that skips one
leaves the others waiting in it. The comment of each line below that makes one, or leads to
one, says which. Rank 0 alone prints and writes. docs/how-it-works.md says why each call is
where it is.
"""
import signal

from cluster.sigterm import Preemption

# SIGTERM, in each process mp.spawn starts (which runs this file from the top too): before
# training it exits 75, for the scheduler to requeue the job; during training every rank stops
# after the same step and rank 0 saves the position. Set first: loading torch takes seconds.
preemption = Preemption()
signal.signal(signal.SIGTERM, preemption.on_sigterm)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # mp.spawn starts a process with it blocked (main())

import datetime
import multiprocessing.resource_tracker
import os
import sys
import threading
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

# The data-parallel core: the lesson, with this file (docs/how-it-works.md walks through it).
from model import cpu_sync_batchnorm
from multi_train_utils.config import check_and_list_images, read_command_line
from multi_train_utils.distributed_utils import (Ranks, job_store, join_processes, meeting_point,
                                                 process_context)
from multi_train_utils.loaders import build_datasets
from multi_train_utils.resume import restore_training
from multi_train_utils.train_eval_utils import build_model, build_optimizer, evaluate_epoch, train_one_epoch
# The machinery around it: what a cluster does to a run, and what rank 0 writes.
from cluster.check import check
from cluster.preemption import save_position_and_exit
from outputs import collective_trace
from outputs.report import evaluate_only, report_on_best
from outputs.run_folder import RunFiles, create_run_folder, read_resume_checkpoint
from processes.helper_signals import sigterm_blocked
from utils import exit_on_error


def main() -> None:
    with exit_on_error():
        args = read_command_line("spawn", __doc__)
        # Before any process starts: the options checked, the images downloaded (--download) and listed,
        # the processes counted.
        plan = check_and_list_images(args, "spawn")
        # Where the processes meet, exported for them: --dist-url or MASTER_ADDR:MASTER_PORT, else a free
        # port on 127.0.0.1 (gloo then stays on loopback: GLOO_SOCKET_IFNAME).
        meeting_point(args)
    # A SIGTERM to this launcher alone (a scheduler that signals the main process) is passed on to the
    # processes, each second until they end (join_processes). Each starts with it blocked (exec keeps the
    # mask), pending until its handler is set; the resource tracker first, as its start unblocks it.
    sigterm_came = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: sigterm_came.set())
    multiprocessing.resource_tracker.ensure_running()
    with sigterm_blocked():
        context = mp.spawn(worker, args=(plan,), nprocs=plan.world_size, join=False)
    sys.exit(join_processes(context, sigterm_came))  # the first failure ends the job; Ctrl-C ends them all


def worker(rank: int, plan) -> None:
    """One process of the job, started by mp.spawn with its rank (all on this machine: the
    local rank is the rank)."""
    args = plan.args
    with exit_on_error(rank):
        ranks = Ranks(rank, rank, plan.world_size, plan.world_size)
        if args.check:  # diagnose instead of training
            sys.exit(check(plan, ranks))  # its own group; all_gather, broadcast, all_reduce
        if args.trace_collectives:  # every collective from here on recorded, with the line below that led to it
            collective_trace.start(__file__)
        ctx = process_context(ranks, args.device, args.backend)  # on GPUs, its rank's; its share of the cores
        # init_process_group: complete once every rank has joined (gloo connects to each peer; NCCL,
        # given device_id, its communicator). NCCL on GPUs, gloo on the CPU; a peer missing, dead or stuck
        # becomes an error after --dist-timeout. job_store: rank 0 hosts the store where they meet.
        dist.init_process_group(ctx.backend, store=job_store(ranks, args.dist_timeout),
                                rank=rank, world_size=plan.world_size,
                                timeout=datetime.timedelta(seconds=args.dist_timeout),
                                device_id=ctx.device if ctx.device.type == "cuda" else None)
        ctx.print0(f"process group: backend={dist.get_backend()}, world_size={ctx.world_size}, "
                   f"rendezvous={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, "
                   f"threads per process={torch.get_num_threads()}")
        output_dir = None
        try:
            output_dir = create_run_folder(plan, ctx)  # broadcast: rank 0 creates it (and prints the configuration)
            train(plan, ctx, output_dir)
        finally:
            if args.trace_collectives and output_dir is not None:  # each rank's list, however the run ended
                collective_trace.write(output_dir, ctx)
            dist.destroy_process_group()


def train(plan, ctx, output_dir) -> None:
    """The whole run of one process: `plan` is the checked command line and the images, `ctx`
    this process's rank, device and whether a process group exists, `output_dir` the run folder."""
    args = plan.args
    began = time.perf_counter()
    # --resume's checkpoint, read by every rank (a broadcast under --resume auto: whether rank 0 found last.pth;
    # resuming, an all_gather: every rank read it, at the same position).
    checkpoint = read_resume_checkpoint(args, output_dir, ctx)
    # all_gather: the unreadable files each rank found, so all split alike (resuming: two broadcasts instead,
    # rank 0's view of split.json, then its verdict). --cache and --device-augment add theirs (the tour's table).
    data = build_datasets(plan, checkpoint, ctx)
    # Each rank draws its own 1/world_size of the training images, in a new order every epoch.
    train_sampler = DistributedSampler(data.train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                       seed=args.seed)
    train_loader, val_loader = data.loaders(train_sampler, args, ctx)  # validation: unpadded shards

    model = build_model(args, len(data.class_names), ctx)  # seeded: the same initial weights on every rank
    if args.eval_only:
        # all_reduce and all_gather: the weights --resume or --weights gives, evaluated; their report.
        evaluate_only(model, checkpoint, val_loader, data, output_dir, args, ctx)
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
        # all_gather of the parameter count and a broadcast of rank 0's shapes: DDP checks every rank has the
        # same parameters; broadcast: rank 0's weights and buffers to every rank. backward() will all-reduce
        # the gradients.
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        if args.trace_collectives:  # its gradients' all-reduces made where the trace sees them
            collective_trace.watch_gradients(model)
    if args.compile:
        model = torch.compile(model)
    # After the swap and the wrap: over the parameters the model has now. The learning rate, set at every
    # step, peaks at --lr x global batch / 256: more processes, a larger global batch, a higher rate.
    optimizer, scaler, ema = build_optimizer(model_without_ddp, args, ctx.device)  # ema: --ema's average
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    preemption.training = True  # from here a SIGTERM stops every rank after the same step, the position saved
    # --resume: every rank restores the same optimizer state; a stopped epoch goes on after its last step.
    progress = restore_training(checkpoint, optimizer, scaler, ema, train_loader, data.lost_files, args, ctx)

    best = None
    files = RunFiles(output_dir, plan, data.split, data.root, progress, model_without_ddp, optimizer, scaler, ema,
                     ctx, began) if ctx.is_main else None
    # Rank 0's files: config.json and the split written as it is entered, each epoch's beside the training.
    with files or nullcontext():
        for epoch in range(progress.epoch + 1, progress.last_epoch + 1):
            if args.time_budget:
                # broadcast, once epoch 1 has run: rank 0's count of the epochs that fit (the crops follow it).
                progress.fit_epochs_to_budget(args, train_loader, output_dir, ctx)
                # broadcast: rank 0's clock decides for every rank whether this epoch runs.
                if not progress.budget_allows(epoch, args, ctx):
                    break
            train_sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            # all_reduce: DDP's of the gradients in the backward() that closes each step, a small one at
            # least every 20 steps (a NaN loss or a SIGTERM on any rank stops them all), and the epoch's loss
            # and accuracy. broadcast: DDP's of rank 0's buffers in the forward of each step's first batch.
            train_stats = train_one_epoch(model, criterion, optimizer, scaler, train_loader, epoch, progress,
                                          args, ctx, ema, preemption.requested)
            if train_stats["stopped_after"]:  # SIGTERM: every rank stopped after the same step
                save_position_and_exit(files, epoch, progress, train_stats, output_dir, ctx)  # barrier, exit 75
            # broadcast: rank 0's BatchNorm statistics, so that every rank evaluates the weights it saves;
            # all_reduce: exact, every image once.
            evaluated = evaluate_epoch(model_without_ddp, val_loader, args, ctx, ema, data.recalibrate)
            is_best = evaluated.better_acc > progress.best_acc
            if is_best:
                best = (epoch, evaluated)
            progress.finish_epoch(epoch, evaluated.better_acc, train_stats, evaluated.seconds)
            # Rank 0 alone saves (torch.save, on a thread: save_atomic() in multi_train_utils/checkpoint.py);
            # the others go on to their next collective.
            if ctx.is_main:
                files.save_epoch(epoch, progress, train_stats, evaluated, is_best)
            if args.trace_collectives:  # rank 0 prints where the ranks met in this epoch
                collective_trace.print_epoch(epoch, output_dir, ctx)
        # all_reduce and all_gather: best.pth's report, from the outputs its epoch kept (a broadcast if it reloads).
        report_on_best(model_without_ddp, val_loader, data, output_dir, args, ctx, best)


if __name__ == "__main__":
    main()
