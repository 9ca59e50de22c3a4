"""Train ResNet34 on an image folder in one process, on one GPU or the CPU.

    python train_single_gpu.py --data-path data/flower_photos_sample --epochs 3
    python train_single_gpu.py --device cuda:1 --data-path dataset/flower_photos --download
    python train_single_gpu.py --data-path dataset/flower_photos --check    # diagnose, do not train

`--help` lists every option and docs/options.md says what each does; all three launchers share
them. The multi-GPU launchers run the same steps in every process, and add the process group,
SyncBatchNorm, the DDP wrap and the collectives that keep the processes in step: `diff
train_single_gpu.py train_multi_gpu_using_launch.py` shows them, and docs/how-it-works.md says
why each call is where it is.
"""
import signal
import sys
import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

# The core: the lesson, with this file.
from model import create_model
from multi_train_utils.checkpoint import make_checkpoint, save_checkpoint
from multi_train_utils.config import DEFAULT_EPOCHS, check_options, get_args_parser, list_images_of
from multi_train_utils.distributed_utils import ShardSampler, job_precision, loader_options, process_context
from multi_train_utils.run_folder import create_run_folder, epoch_line, epoch_record, write_epoch, write_run_files
from multi_train_utils.train_eval_utils import Extras, Progress, build_optimizer, evaluate, train_one_epoch
from my_dataset import EpochKeys, train_and_val_sets
from utils import exit_on_error, split_samples
# What a default run never enters: each is one `if` below.
from cluster import preemption
from multi_train_utils import resume
from outputs import report
from recipe import budget, extras


@exit_on_error  # an error: one `error:` line (or a traceback) and an exit code; Ctrl-C: 130
def main() -> None:
    args = get_args_parser(__doc__, "single").parse_args()
    check_options(args, "single")  # a mistake is one `error:` line
    plan = list_images_of(args, "single")  # --download; the class folders, or the folder's train/ and val/
    if args.check:  # diagnose instead of training
        from cluster.check import check  # a program of its own: imported only here
        sys.exit(check(plan, None))
    ctx = process_context(None, args.device)  # the device, and this process's share of the CPUs
    output_dir = create_run_folder(args, "single", ctx)  # and the configuration printed
    train(plan, ctx, output_dir)


def train(plan, ctx, output_dir) -> None:
    """The whole run: `plan` is the checked command line and the images, `ctx` the one process's
    device: rank 0 of 1, no process group, so every collective the multi-GPU launchers make is
    plain arithmetic here (a sum of one) or nothing. `output_dir`: the run folder."""
    args = plan.args
    checkpoint = None
    if args.resume:  # --resume's checkpoint
        checkpoint = resume.read_checkpoint(args, output_dir, ctx)
    if checkpoint or args.check_images:  # the run's recorded files, or those that decode
        split, data_root, dropped_some_files = resume.checked_split(plan, checkpoint, ctx)
    else:  # stratified by class, drawn by --seed (or the folder's own train/ and val/)
        split, data_root, dropped_some_files = split_samples(plan.samples, plan.class_names, args.val_rate, args.seed,
                                                     plan.val_files), args.data_path, False
    ctx.print0(split.summary())
    train_set, val_set = train_and_val_sets(split, args)
    if args.cache or args.device_augment:  # the pictures decoded once
        train_set, val_set = extras.decoded_once(split, train_set, val_set, args, ctx)
    # A DistributedSampler of one replica: a new order of the training images every epoch, as the multi-GPU
    # launchers draw them.
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                       seed=args.seed)
    options = loader_options(args, ctx)  # batches, workers (its CPUs less one), pinned memory for a GPU
    # A last batch of one image breaks BatchNorm in training mode: dropped (the shuffle changes which images it holds).
    train_loader = DataLoader(train_set, sampler=EpochKeys(train_sampler), **options,
                              drop_last=len(train_sampler) > args.batch_size)
    val_loader = DataLoader(val_set, sampler=ShardSampler(len(val_set), ctx), **options)  # each image once
    if args.device_augment:  # each batch cropped on the device, from the pictures decoded there
        train_loader, val_loader = extras.device_loaders(train_loader, val_loader, args, ctx)

    torch.manual_seed(args.seed)  # the same initial weights in every rerun
    model = create_model(len(split.class_names), args.model, args.zero_init_residual, args.blurpool)
    if args.weights or args.freeze_layers:  # the weights to start from; the classifier alone trains
        extras.initial_weights(model, args, ctx)
    model.to(ctx.device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    amp_dtype = job_precision(args.amp, ctx)  # the precision this device runs natively
    if args.eval_only:  # the weights --resume or --weights gives, evaluated; their report
        report.evaluate_only(model, checkpoint, val_loader, split, output_dir, args, ctx)
        return
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
    if ctx.device.type == "cuda":  # cuDNN's autotuning; a CUDA graph's side stream
        extras.prepare_gpu(args, ctx)
    # One process: no SyncBatchNorm, no DistributedDataParallel; the multi-GPU launchers wrap the model here.
    model_without_ddp = model  # what is saved and evaluated: its weights load under any launcher
    if args.compile:
        model = torch.compile(model)
    # The learning rate, set at every step, peaks at --lr x batch / 256.
    optimizer, scaler = build_optimizer(model_without_ddp, args, amp_dtype)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    extra = Extras()
    if args.ema or args.mixup_alpha or args.cutmix_alpha or args.bn_recalibrate or ctx.device.type == "cuda":
        extra = extras.training_extras(model, model_without_ddp, optimizer, split, args, ctx)  # and a CUDA graph
    progress = Progress(last_epoch=budget.most_epochs(args) if args.time_budget else args.epochs or DEFAULT_EPOCHS)
    if checkpoint:  # the optimizer state; a stopped epoch goes on after its last step
        progress = resume.restore_training(checkpoint, progress, optimizer, scaler, extra, train_loader,
                                           dropped_some_files, args, ctx)
    ctx.print0(f"training: epoch {progress.epoch + 1} of {progress.last_epoch}, {len(train_loader)} batches a process")
    tensorboard = SummaryWriter(output_dir) if ctx.is_main else None  # its writer thread is torch's
    if ctx.is_main:  # config.json, class_indices.json, split.json
        write_run_files(output_dir, args, plan.launcher, split, data_root, ctx, progress)

    # From here a SIGTERM (SLURM's warning, scancel, `kill`) is a request: the run stops after its step of training
    # or evaluation, saves the position and exits 75. Before, it ends the process at once (nothing to save); after
    # the last epoch's evaluation, nothing reads it.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    for epoch in range(progress.epoch + 1, progress.last_epoch + 1):
        if args.time_budget and not budget.next_epoch_fits(progress, epoch, train_loader, output_dir, args, ctx):
            break
        train_sampler.set_epoch(epoch)  # a new shuffle every epoch
        # Every 20 steps (or 5 s) a look: a NaN loss ends the run, a SIGTERM stops it after that step.
        trained = train_one_epoch(model, criterion, optimizer, scaler, train_loader, epoch, progress, amp_dtype,
                                  args, ctx, extra, stop.is_set)
        # Every image once; about every 5 s, whether a SIGTERM came.
        evaluated = None if trained.stopped else evaluate(model_without_ddp, val_loader, args, ctx, extra, stop.is_set,
                                                          trained.seconds_per_step)
        if trained.stopped or evaluated.stopped:  # SIGTERM: the position saved, exit 75
            preemption.save_position_and_exit(model_without_ddp, optimizer, scaler, extra, progress, trained, epoch,
                                              split, output_dir, args, ctx)
        is_best = progress.finish_epoch(epoch, trained, evaluated)
        if ctx.is_main:  # rank 0 of 1: the multi-GPU launchers' `if` kept, the same lines
            record = epoch_record(epoch, trained, evaluated, split, args, ctx)
            print(epoch_line(record, progress.last_epoch, is_best), flush=True)
            write_epoch(output_dir, record, tensorboard)  # metrics.jsonl and TensorBoard, before the checkpoint
            # torch.save to a temporary file, renamed over last.pth (and best.pth first, when the epoch is the best).
            save_checkpoint(make_checkpoint(model_without_ddp, optimizer, scaler, progress, args, split.class_names,
                                            ctx.world_size, extra, evaluated), output_dir, is_best)
    if args.report:  # best.pth's weights, class by class
        report.report_on_best(model_without_ddp, val_loader, split, output_dir, args, ctx)
    if ctx.is_main:
        tensorboard.close()
        if args.plots:  # the curves, the classes, augmented samples and the report's pictures, as PNGs
            report.draw_plots(output_dir)
        print(f"done: best val_acc {progress.best_acc:.4f}; checkpoints and logs in {output_dir}", flush=True)


if __name__ == "__main__":
    main()
