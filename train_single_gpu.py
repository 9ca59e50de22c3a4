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

from cluster.sigterm import Preemption

# SIGTERM, however it comes (SLURM's time limit, scancel, `kill`): before training this process
# exits 75, for the scheduler to requeue the job; during training it stops after the step it is
# in and saves the position. Set first: loading torch takes seconds.
preemption = Preemption()
signal.signal(signal.SIGTERM, preemption.on_sigterm)

import sys
import time

import torch
from torch import nn
from torch.utils.data import DistributedSampler

# The data-parallel core: the lesson, with this file (docs/how-it-works.md walks through it).
from multi_train_utils.config import check_and_list_images, read_command_line
from multi_train_utils.distributed_utils import process_context
from multi_train_utils.loaders import build_datasets
from multi_train_utils.resume import restore_training
from multi_train_utils.train_eval_utils import build_model, build_optimizer, evaluate_epoch, train_one_epoch
# The machinery around it: what a cluster does to a run, and what rank 0 writes.
from cluster.check import check
from cluster.preemption import save_position_and_exit
from outputs.report import evaluate_only, report_on_best
from outputs.run_folder import RunFiles, create_run_folder, read_resume_checkpoint
from utils import exit_on_error


@exit_on_error()  # our own errors: one `error:` line and an exit code, no traceback; Ctrl-C: 130
def main() -> None:
    args = read_command_line("single", __doc__)
    plan = check_and_list_images(args, "single")  # options checked, images downloaded (--download) and listed
    if args.check:
        sys.exit(check(plan, None))
    ctx = process_context(None, args.device)  # the device, and this process's share of the cores
    output_dir = create_run_folder(plan, ctx)  # and the configuration printed
    train(plan, ctx, output_dir)


def train(plan, ctx, output_dir) -> None:
    """The whole run: `plan` is the checked command line and the images, `ctx` the one process's
    device: rank 0 of 1, no process group, so every collective the multi-GPU launchers make is
    plain arithmetic here (a sum of one) or nothing. `output_dir`: the run folder."""
    args = plan.args
    began = time.perf_counter()
    checkpoint = read_resume_checkpoint(args, output_dir, ctx)  # --resume's, or None
    data = build_datasets(plan, checkpoint, ctx)  # the unreadable files left out, the images split
    # A DistributedSampler of one replica: a new order of the training images every epoch,
    # as the multi-GPU launchers draw them.
    train_sampler = DistributedSampler(data.train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                       seed=args.seed)
    train_loader, val_loader = data.loaders(train_sampler, args, ctx)  # validation: unpadded shards

    model = build_model(args, len(data.class_names), ctx)  # seeded: the same initial weights every run
    if args.eval_only:
        evaluate_only(model, checkpoint, val_loader, data, output_dir, args, ctx)
        return
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
    # One process: no SyncBatchNorm, no DistributedDataParallel; the multi-GPU launchers wrap the model here.
    model_without_ddp = model  # what is saved, evaluated and averaged: its weights load under any launcher
    if args.compile:
        model = torch.compile(model)
    # The learning rate, set at every step, peaks at --lr x batch / 256.
    optimizer, scaler, ema = build_optimizer(model_without_ddp, args, ctx.device)  # ema: --ema's average
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    preemption.training = True  # from here a SIGTERM stops the run after its step, the position saved
    # --resume: the optimizer state restored; a stopped epoch goes on after its last step.
    progress = restore_training(checkpoint, optimizer, scaler, ema, train_loader, data.lost_files, args, ctx)

    best = None
    files = RunFiles(output_dir, plan, data.split, data.root, progress, model_without_ddp, optimizer, scaler, ema,
                     ctx, began)
    with files:  # config.json and the split written now, each epoch's files beside the training
        for epoch in range(progress.epoch + 1, progress.last_epoch + 1):
            if args.time_budget:
                progress.fit_epochs_to_budget(args, train_loader, output_dir, ctx)  # once epoch 1 has run
                if not progress.budget_allows(epoch, args, ctx):
                    break
            train_sampler.set_epoch(epoch)  # a new shuffle every epoch
            # Every 20 steps a look: a NaN loss ends the run, a SIGTERM stops it after that step.
            train_stats = train_one_epoch(model, criterion, optimizer, scaler, train_loader, epoch, progress,
                                          args, ctx, ema, preemption.requested)
            if train_stats["stopped_after"]:  # SIGTERM
                save_position_and_exit(files, epoch, progress, train_stats, output_dir, ctx)  # exit 75
            evaluated = evaluate_epoch(model_without_ddp, val_loader, args, ctx, ema, data.recalibrate)
            is_best = evaluated.better_acc > progress.best_acc
            if is_best:
                best = (epoch, evaluated)
            progress.finish_epoch(epoch, evaluated.better_acc, train_stats, evaluated.seconds)
            files.save_epoch(epoch, progress, train_stats, evaluated, is_best)
        # best.pth's report, from the outputs its epoch's evaluation kept.
        report_on_best(model_without_ddp, val_loader, data, output_dir, args, ctx, best)


if __name__ == "__main__":
    main()
