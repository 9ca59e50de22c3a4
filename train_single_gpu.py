"""Train ResNet34 on an image folder in one process, on one GPU or the CPU.

    python train_single_gpu.py --data-path data/flower_photos_sample --epochs 3
    python train_single_gpu.py --device cuda:1 --data-path dataset/flower_photos --download
    python train_single_gpu.py --data-path dataset/flower_photos --check    # diagnose, do not train

See README.md for every option; all three launchers share them. The multi-GPU launchers run the
same steps in every process, and add the process group, SyncBatchNorm and the DDP wrap:
`diff train_single_gpu.py train_multi_gpu_using_launch.py` is the whole difference, and
docs/how-it-works.md says why each call is where it is.
"""
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

from multi_train_utils.check import check
from multi_train_utils.config import Plan, announce, get_args_parser, prepare
from multi_train_utils.distributed_utils import DistContext, setup_single
from multi_train_utils.epochs import EpochCount, RunTimes
from multi_train_utils.faults import named_faults
from multi_train_utils.loaders import EpochPasses, build_loaders, run_data
from multi_train_utils.plotter import Plotter
from multi_train_utils.preemption import TerminationRequest, save_position_and_exit
from multi_train_utils.recalibrate import recalibration
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
from utils import exit_on_error


def main() -> None:
    args = get_args_parser(__doc__.splitlines()[0], launcher="single").parse_args()
    with exit_on_error():
        plan = prepare(args, launcher="single")  # checked options, the images listed
        if args.check:
            sys.exit(check(plan, None))
        train(plan, setup_single(args.device))  # the device, and this process's threads


def train(plan: Plan, ctx: DistContext) -> None:
    """The whole run. `ctx` is the one process's: rank 0 of 1, on its device, no process group;
    the collectives the multi-GPU launchers run (the metrics' all-reduce) are then plain sums."""
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
            # A DistributedSampler of one replica shuffles the training images, as in the multi-GPU launchers.
            train_loader, val_loader = build_loaders(data.split, plan, ctx)
            placed = building.result()  # the bare model on its device
        for line in said:
            ctx.print0(line)
        resumed.restore_weights(placed.module, data.split, args)
        if args.eval_only:
            evaluate_only(placed, val_loader, data.split, resumed.path or args.weights, output_dir, plotter, args, ctx)
            return

        # One process: no SyncBatchNorm, no DistributedDataParallel; the multi-GPU launchers wrap the model here.
        training = build_training(placed, args, ctx, len(train_loader))  # the optimizer, its lr schedule, the loss
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
                # DistributedSampler: a new shuffle every epoch. A resumed epoch skips the batches trained on
                # before the stop. (Its pass may have begun loading already, during the last evaluation:
                # load_ahead() set the sampler to this epoch then.)
                train_loader.sampler.set_epoch(epoch, skip=progress.steps_in_epoch * args.batch_size)
                try:
                    train_stats = train_one_epoch(training, passes.train(epoch), ctx, epoch, epochs.total(),
                                                  progress.steps_in_epoch, progress.epoch_sums)
                except StoppedInEpoch as stop:  # SIGTERM
                    save_position_and_exit(stop, training, progress, epoch, args, data.split, output_dir, files, ctx)
                epochs.trained()
                passes.load_ahead(next_epoch=epochs.next_after(epoch))  # validation's batches, then the next epoch's
                evaluated = evaluate_epoch(training, passes.val, ctx, recalibrate)  # exact, all-reduced
                took = epochs.evaluated()
                is_best = progress.record(epoch, evaluated.acc, took.train, took.eval)
                if is_best:
                    best = BestEpoch(epoch, evaluated.better, evaluated.outputs)
                training = epochs.timed(took, training)  # under --time-budget, epoch 1 fixes the count
                if ctx.is_main:  # always, in one process; the multi-GPU launchers' rank 0
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
