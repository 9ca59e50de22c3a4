"""Train ResNet34 with DistributedDataParallel, one process per GPU, started by torchrun.

    torchrun --nproc_per_node=4 train_multi_gpu_using_launch.py --data-path dataset/flower_photos
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        train_multi_gpu_using_launch.py ...
    srun python train_multi_gpu_using_launch.py ...      # SLURM, one task per GPU
    torchrun --nproc_per_node=4 train_multi_gpu_using_launch.py ... --check   # diagnose, do not train

Rank, local rank and world size come from the environment that torchrun, the legacy
`python -m torch.distributed.launch` or SLURM sets. Run without any of them, it trains in
one process. See README.md for every option; all three launchers share them.

Every process runs this file from the top: it joins the process group, trains on its own
share of the images, and all of them meet at each collective (the gradient all-reduce inside
DDP's backward pass, the metrics' all-reduce after each epoch). Rank 0 alone prints and writes.
docs/how-it-works.md says why each call is where it is; `diff train_single_gpu.py` this file
shows what one GPU becomes many by.
"""
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import convert_sync_batchnorm
from multi_train_utils.check import check
from multi_train_utils.config import Plan, announce, get_args_parser, prepare
from multi_train_utils.distributed_utils import DistContext, setup_process_group, setup_single
from multi_train_utils.epochs import EpochCount, RunTimes
from multi_train_utils.faults import named_faults
from multi_train_utils.loaders import EpochPasses, build_loaders, run_data
from multi_train_utils.plotter import Plotter
from multi_train_utils.preemption import TerminationRequest, save_position_and_exit
from multi_train_utils.recalibrate import recalibration
from multi_train_utils.rendezvous import Rendezvous, env_ranks, parse_dist_url
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
from utils import UserError, exit_on_error


def main() -> None:
    args = get_args_parser(__doc__.splitlines()[0], launcher="launch").parse_args()
    with exit_on_error():
        # Who this process is: torchrun (or srun) started one per GPU and told each its ranks.
        ranks = env_ranks(args.local_rank)
        rank, local_rank, world_size, local_world_size = ranks or (0, 0, 1, 1)
        if args.world_size is not None and args.world_size != world_size:
            raise UserError(f"--world-size is {args.world_size}, but {world_size} process(es) were started: "
                            "start as many as you ask for (torchrun --nproc_per_node, srun --ntasks), or drop it")
        plan = prepare(args, launcher="launch", verbose=local_rank == 0)  # checked options, the images listed
        if rank == 0 and parse_dist_url(args.dist_url):
            where = (f"the one torchrun or srun set, {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                     if ranks else "not needed for one process")
            print(f"--dist-url {args.dist_url} is not used: the rendezvous is {where}")
        if ranks is None:
            if args.check:
                sys.exit(check(plan, None))
            print("not started by torchrun or srun: training in one process")
            train(plan, setup_single(args.device))
            return
        if args.check:
            sys.exit(check(plan, Rendezvous(rank, local_rank, world_size, local_world_size)))
        # The rendezvous at MASTER_ADDR:MASTER_PORT, then dist.init_process_group: NCCL on GPUs, gloo on the CPU.
        ctx = setup_process_group(rank, local_rank, world_size, local_world_size, args.device, args.backend,
                                  args.dist_timeout)
        try:
            train(plan, ctx)
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
