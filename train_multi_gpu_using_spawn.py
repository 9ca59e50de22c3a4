"""Train ResNet34 with DistributedDataParallel, processes started by torch.multiprocessing.spawn.

    python train_multi_gpu_using_spawn.py --data-path dataset/flower_photos          # one per GPU
    python train_multi_gpu_using_spawn.py --world-size 2 --data-path data/flower_photos_sample

No launcher needed: this script starts the processes itself, on this machine only, and picks a
free port on 127.0.0.1 unless MASTER_ADDR/MASTER_PORT are set. On a machine without GPUs,
--world-size N runs N CPU processes with gloo. See README.md for every option.

main() starts the processes; each runs worker(): it joins the process group, trains on its own
share of the images, and all of them meet at each collective (the gradient all-reduce inside
DDP's backward pass, the metrics' all-reduce after each epoch). Rank 0 alone prints and writes.
docs/how-it-works.md says why each call is where it is; `diff train_single_gpu.py` this file
shows what one GPU becomes many by.
"""
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from model import convert_sync_batchnorm
from multi_train_utils.check import check
from multi_train_utils.config import Plan, announce, get_args_parser, prepare
from multi_train_utils.distributed_utils import (
    STOP_GRACE_SECONDS,
    DistContext,
    forward_signal,
    parse_device,
    resolve_device,
    setup_process_group,
    stop,
)
from multi_train_utils.epochs import EpochCount, RunTimes
from multi_train_utils.faults import named_faults
from multi_train_utils.loaders import EpochPasses, build_loaders, run_data
from multi_train_utils.plotter import Plotter
from multi_train_utils.preemption import TerminationRequest, save_position_and_exit
from multi_train_utils.recalibrate import recalibration
from multi_train_utils.rendezvous import Rendezvous, host_store, keep_gloo_on_loopback, parse_dist_url
from multi_train_utils.report import BestEpoch, evaluate_only, report_of_best
from multi_train_utils.resume import resume_point
from multi_train_utils.run_folder import (
    EpochWriter,
    checkpoint_of,
    epoch_line,
    epoch_record,
    prepare_output_dir,
    write_run_files,
)
from multi_train_utils.train_eval_utils import (
    StoppedInEpoch,
    build_model,
    build_training,
    evaluate_epoch,
    train_one_epoch,
)
from utils import ProjectError, UserError, exit_on_error, stderr_line


def main() -> None:
    args = get_args_parser(__doc__.splitlines()[0], launcher="spawn").parse_args()
    with exit_on_error():
        gpus = torch.cuda.device_count() if parse_device(args.device).type == "cuda" else 0
        world_size = args.world_size or gpus
        if world_size < 1:
            raise UserError("no GPU is visible: pass --world-size N to train with N CPU processes (gloo)")
        if gpus and world_size > gpus:
            raise UserError(f"--world-size {world_size} is more than the {gpus} visible GPU(s)")
        resolve_device(args.device, 0, world_size, distributed=True)  # what every process would check, once
        plan = prepare(args, launcher="spawn")
        # All processes run on this machine, so by default nothing listens beyond loopback.
        host, port = parse_dist_url(args.dist_url) or (os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                                        int(os.environ.get("MASTER_PORT", "0")))
        store = host_store(host, port, args.dist_timeout)
        loopback = keep_gloo_on_loopback(host)
        if loopback:
            print(f"GLOO_SOCKET_IFNAME={loopback} (gloo stays on loopback)")

    # A scheduler may signal the launcher alone: its processes then save where they are and exit (75).
    # The handler goes in first: until then a SIGTERM would end the launcher and leave them running.
    processes: list = []
    terminated: list[int] = []

    def forward_sigterm(*_) -> None:
        terminated.append(signal.SIGTERM)
        forward_signal(processes, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward_sigterm)
    context = mp.spawn(worker, args=(plan, world_size, (host, store.port)), nprocs=world_size, join=False)
    processes.extend(context.processes)
    if terminated:  # it came while they were starting
        forward_signal(processes, signal.SIGTERM)
    try:
        while not context.join(grace_period=STOP_GRACE_SECONDS):
            pass
    except mp.ProcessExitedException as e:
        # The process printed its own `error:` line unless a signal gave it no chance to.
        if e.signal_name:
            stderr_line(f"error: process {e.error_index} was killed by {e.signal_name}")
        sys.exit(e.exit_code if e.exit_code > 0 else 1)
    except mp.ProcessRaisedException as e:
        stderr_line(str(e))  # the failing rank's traceback
        sys.exit(1)
    except KeyboardInterrupt:
        stop(context.processes)
        stderr_line("interrupted")
        sys.exit(130)


def worker(rank: int, plan: Plan, world_size: int, store_address: tuple[str, int]) -> None:
    """One process of the job, started by mp.spawn with its rank (all on this machine: the
    local rank is the rank)."""
    args = plan.args
    with exit_on_error():
        try:
            if args.check:
                sys.exit(check(plan, Rendezvous(rank, rank, world_size, world_size, store_address)))
            # The rendezvous at the store main() hosts, then dist.init_process_group: NCCL on GPUs, gloo on the CPU.
            ctx = setup_process_group(rank, rank, world_size, world_size, args.device, args.backend,
                                      args.dist_timeout, store_address)
            train(plan, ctx)
        except ProjectError:
            raise
        except Exception as e:
            # mp.spawn shows the traceback of one failed process, the first it notices: often a
            # rank that only lost its peer. Each rank's own line keeps the first cause on screen.
            stderr_line(f"rank {rank}: {type(e).__name__}: {e}")
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def train(plan: Plan, ctx: DistContext) -> None:
    """The whole run of one process. `ctx` says which process it is (rank, device), and whether
    a process group exists."""
    args = plan.args
    times = RunTimes()
    output_dir = prepare_output_dir(plan, ctx)  # rank 0 creates it; every rank learns its name
    plotter = Plotter(output_dir) if ctx.is_main and args.plots else None  # forked before any thread starts
    with plotter or nullcontext():
        resumed = resume_point(plan, output_dir, ctx)  # --resume: the checkpoint to go on from, if any

        # The model is built on a thread while this one lists and splits the data: neither needs the other.
        with ThreadPoolExecutor(max_workers=1) as beside:
            said: list[str] = []
            building = beside.submit(build_model, args, resumed.num_classes(plan), ctx.device, said.append)
            data = run_data(plan, resumed.path, ctx)  # the split, the same on every rank (they compare notes)
            announce(plan, data.split, output_dir, ctx)
            # Training: a DistributedSampler gives each rank 1/world_size of the images.
            # Validation: disjoint shards without padding, every image evaluated once.
            train_loader, val_loader = build_loaders(data.split, plan, ctx)
            placed = building.result()  # the bare model on this rank's device
        for line in said:
            ctx.print0(line)
        resumed.restore_weights(placed.module, data.split, args)
        if args.eval_only:
            evaluate_only(placed, val_loader, data.split, resumed.path or args.weights, output_dir, plotter, args, ctx)
            return

        if args.sync_bn and ctx.distributed:
            # BatchNorm's statistics over the whole global batch, not each rank's share; before DDP wraps the model.
            placed = placed.with_module(convert_sync_batchnorm(placed.module, ctx.device))
        model = placed.module
        if ctx.distributed:
            # DDP copies rank 0's weights to every rank now, and all-reduces the gradients in backward().
            model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        # The optimizer comes after the swap and the wrap, over the parameters the model has now; the peak
        # learning rate scales with the global batch (--lr is per 256 images: more processes, a larger rate).
        training = build_training(placed, args, ctx, len(train_loader), model)
        progress = resumed.restore(training, args, data.lost_files, ctx)  # epochs done, optimizer and scaler state
        if ctx.is_main:
            write_run_files(output_dir, plan, data, progress.epoch, ctx)
        if plotter:
            plotter.draw_data()

        times.epochs_begin()
        epochs = EpochCount(args, progress, train_loader, output_dir, ctx)  # --epochs, or what --time-budget fits
        passes = EpochPasses(train_loader, val_loader, val_ahead=ctx.device.type != "cpu")  # batches loaded ahead
        recalibrate = recalibration(data.split, args)  # --bn-recalibrate, else None
        best = None
        files = EpochWriter(output_dir) if ctx.is_main else None  # rank 0's files, written beside the training
        # A fault in the epochs (a peer gone, a loader worker dead, a failed write) ends in one named paragraph.
        with named_faults(output_dir, ctx), TerminationRequest() as sigterm, files or nullcontext():
            training = epochs.fitted(training.until(sigterm))
            for epoch in epochs:
                # DistributedSampler: a new shuffle every epoch, the same on every rank. A resumed epoch skips
                # the batches this rank trained on before the stop. (Its pass may have begun loading already,
                # during the last evaluation: load_ahead() set the sampler to this epoch then.)
                train_loader.sampler.set_epoch(epoch, skip=progress.steps_in_epoch * args.batch_size)
                try:
                    train_stats = train_one_epoch(training, passes.train(epoch), ctx, epoch, epochs.total(),
                                                  progress.steps_in_epoch, progress.epoch_sums)
                except StoppedInEpoch as stop:  # SIGTERM: every rank stopped at the same step
                    save_position_and_exit(stop, training, progress, epoch, args, data.split, output_dir, files, ctx)
                epochs.trained()
                passes.load_ahead(next_epoch=epochs.next_after(epoch))  # validation's batches, then the next epoch's
                evaluated = evaluate_epoch(training, passes.val, ctx, recalibrate)  # exact, all-reduced
                took = epochs.evaluated()
                is_best = progress.record(epoch, evaluated.acc, took.train, took.eval)
                if is_best:
                    best = BestEpoch(epoch, evaluated.better, evaluated.outputs)
                training = epochs.timed(took, training)  # under --time-budget, epoch 1 fixes the count
                if ctx.is_main:  # the bare model's weights (no DDP prefix): they load under any launcher
                    record = epoch_record(epoch, train_stats, evaluated, took, training, data.split, ctx)
                    files.save_epoch(checkpoint_of(training, progress, args, data.split, ctx, evaluated), record,
                                     is_best)
                    print(epoch_line(record, epochs.total(), is_best), flush=True)
        times.epochs_end()
        report_of_best(best, training.placed, val_loader, data.split, output_dir, ctx)  # report.json
        times.reported()
        if plotter:
            plotter.draw_results()
    ctx.print0(times.line(plotter.waited_line() if plotter else ""))
    ctx.print0(f"done: best val_acc {progress.best_acc:.4f}; checkpoints and logs in {output_dir}")


if __name__ == "__main__":
    main()
