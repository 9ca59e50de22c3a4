"""Train ResNet34 with DistributedDataParallel, processes started by torch.multiprocessing.spawn.

    python train_multi_gpu_using_spawn.py --data-path dataset/flower_photos          # one per GPU
    python train_multi_gpu_using_spawn.py --world-size 2 --data-path data/flower_photos_sample

No launcher needed: this script starts the processes itself, on this machine only, and picks a
free port on 127.0.0.1 unless MASTER_ADDR/MASTER_PORT are set. On a machine without GPUs,
--world-size N runs N CPU processes with gloo. `--help` lists every option, docs/options.md
says what each does.

main() starts the processes; each runs worker() and then train(), on its own share of the
images: train() is a copy of the torchrun launcher's, line for line,
so that each launcher reads alone. The rule of collectives: every rank makes the same
collectives (all_reduce, broadcast, gather, barrier) in the same order, and none under `if rank
== 0:`; a rank that skips one leaves the others waiting in it. Each line below that makes one,
or calls the function that makes it, says which in its comment: a default run makes no other.
Rank 0 alone prints and writes. docs/how-it-works.md walks through the run.
"""
import datetime
import signal
import sys
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

# The data-parallel core: the lesson, with this file.
from model import cpu_sync_batchnorm, create_model
from multi_train_utils.checkpoint import make_checkpoint, save_checkpoint
from multi_train_utils.config import DEFAULT_EPOCHS, check_options, get_args_parser, list_images_of, spawn_world_size
from multi_train_utils.distributed_utils import Ranks, ShardSampler, job_precision, loader_options, process_context
from multi_train_utils.run_folder import create_run_folder, epoch_line, epoch_record, write_epoch, write_run_files
from multi_train_utils.train_eval_utils import Extras, Progress, build_optimizer, evaluate, train_one_epoch
from my_dataset import EpochKeys, train_and_val_sets
from utils import exit_on_error, split_samples
from cluster import rendezvous  # where the processes meet, and the wait for them: main()'s, every run
# What a default run never enters: each is one `if` below.
from cluster import preemption
from multi_train_utils import resume
from outputs import collective_trace, report, scaling
from recipe import budget, extras


@exit_on_error  # an error: one `error:` line (or a traceback) and an exit code; Ctrl-C: 130
def main() -> None:
    args = get_args_parser(__doc__, "spawn").parse_args()
    check_options(args, "spawn")  # before any process starts: a mistake is one `error:` line
    world_size = spawn_world_size(args)  # --world-size, else one process per visible GPU
    plan = list_images_of(args, "spawn", world_size=world_size)  # --download; the class folders, or train/ and val/
    # Where the processes meet, exported for them: --dist-url, else MASTER_ADDR:MASTER_PORT, else a free port on
    # 127.0.0.1 (gloo then stays on loopback: GLOO_SOCKET_IFNAME).
    rendezvous.meeting_point(args)
    signal.signal(signal.SIGTERM, rendezvous.end_with_the_started)  # while they start: passed on, and all end
    context = mp.spawn(worker, args=(plan,), nprocs=world_size, join=False)
    # The first failure ends the job; a SIGTERM to this process alone is passed on to them; Ctrl-C ends them all.
    sys.exit(rendezvous.join_processes(context))


@exit_on_error  # in each process: its own `error:` line (or traceback) and exit code
def worker(rank: int, plan) -> None:
    """One process of the job, started by mp.spawn with its rank (all on this machine: the local
    rank is the rank)."""
    args = plan.args
    ranks = Ranks(rank, rank, plan.world_size, plan.world_size)
    if args.check:  # diagnose instead of training, in a group of its own: all_gather, broadcast, all_reduce
        from cluster.check import check  # a program of its own: imported only here
        sys.exit(check(plan, ranks))
    ctx = process_context(ranks, args.device, args.backend)  # its device (its rank's GPU), its share of the CPUs
    if args.trace_collectives:  # the Python-level collectives from here on, each with the line below that led to it
        collective_trace.start(__file__)
    # init_process_group: complete once every rank has joined at MASTER_ADDR:MASTER_PORT, where rank 0 hosts torch's
    # store; a peer missing, dead or stuck becomes an error after --dist-timeout. NCCL on GPUs, gloo on the CPU.
    dist.init_process_group(ctx.backend, rank=rank, world_size=plan.world_size,
                            timeout=datetime.timedelta(seconds=args.dist_timeout),
                            device_id=ctx.device if ctx.device.type == "cuda" else None)
    ctx.print0(f"process group: backend={dist.get_backend()}, world_size={ctx.world_size}, "
               f"threads per process={torch.get_num_threads()}")
    output_dir = None
    try:
        output_dir = create_run_folder(args, "spawn", ctx)  # broadcast: rank 0 creates it, every rank learns where
        train(plan, ctx, output_dir)
    finally:
        if args.trace_collectives and output_dir:  # each rank's list, unless a SIGTERM before training killed it
            collective_trace.write(output_dir, ctx)
        dist.destroy_process_group()


def train(plan, ctx, output_dir) -> None:
    """The whole run of one process: `plan` is the checked command line and the images, `ctx`
    this process's rank and device, and whether a process group exists; `output_dir` the run folder."""
    args = plan.args
    checkpoint = None
    if args.resume:  # broadcast and all_gather: every rank read the same position
        checkpoint = resume.read_checkpoint(args, output_dir, ctx)
    if checkpoint or args.check_images:  # broadcasts (the run's recorded files), or an all_gather (those that decode)
        split, data_root, dropped_some_files = resume.checked_split(plan, checkpoint, ctx)
    else:  # the same on every rank: stratified by class, drawn by --seed (or the folder's own train/ and val/)
        split, data_root, dropped_some_files = split_samples(plan.samples, plan.class_names, args.val_rate, args.seed,
                                                     plan.val_files), args.data_path, False
    ctx.print0(split.summary())
    train_set, val_set = train_and_val_sets(split, args)
    if args.cache or args.device_augment:  # the pictures decoded once: all_gather, broadcast, barriers, all_reduces
        train_set, val_set = extras.decoded_once(split, train_set, val_set, args, ctx)
    # Each rank draws its own 1/world_size of the training images, in a new order every epoch.
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                       seed=args.seed)
    options = loader_options(args, ctx)  # batches, workers (its CPUs less one), pinned memory for a GPU
    # A last batch of one image breaks BatchNorm in training mode: dropped (the shuffle changes which images it holds).
    train_loader = DataLoader(train_set, sampler=EpochKeys(train_sampler), **options,
                              drop_last=len(train_sampler) > args.batch_size)
    val_loader = DataLoader(val_set, sampler=ShardSampler(len(val_set), ctx), **options)  # each image once, unpadded
    if args.device_augment:  # each batch cropped on the device, from the pictures decoded there
        train_loader, val_loader = extras.device_loaders(train_loader, val_loader, args, ctx)

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP copies rank 0's in any case)
    model = create_model(len(split.class_names), args.model, args.zero_init_residual, args.blurpool)
    if args.weights or args.freeze_layers:  # the weights to start from; the classifier alone trains
        extras.initial_weights(model, args, ctx)
    model.to(ctx.device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    amp_dtype = job_precision(args.amp, ctx)  # all_gather: the precision every rank runs natively, one for the job
    if args.eval_only:  # --resume's or --weights' weights: evaluate's broadcast, all_reduce; the report's all_gather
        report.evaluate_only(model, checkpoint, val_loader, split, output_dir, args, ctx)
        return
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
    if args.sync_bn and ctx.distributed:
        # BatchNorm statistics over the global batch, not each rank's share: an all_gather and an all_reduce in
        # each BatchNorm's forward, an all_reduce in its backward. torch's runs on GPUs; ours, the same sums, on gloo.
        model = (nn.SyncBatchNorm.convert_sync_batchnorm if ctx.device.type == "cuda" else cpu_sync_batchnorm)(model)
    if ctx.device.type == "cuda":  # cuDNN's autotuning; before the wrap, a CUDA graph's side stream
        extras.prepare_gpu(args, ctx)
    model_without_ddp = model  # what is saved and evaluated: its weights load under any launcher
    if ctx.distributed:
        # all_gather of the parameters' count and broadcast of rank 0's shapes (DDP checks that every rank has the
        # same model), then broadcast of rank 0's weights and buffers. backward() will all-reduce the gradients.
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        if args.trace_collectives:  # DDP's gradient all-reduces made by torch's allreduce_hook, in Python's sight
            collective_trace.all_reduce_gradients_in_python(model)
    if args.compile:
        model = torch.compile(model)
    # The learning rate, set at every step, peaks at --lr x global batch / 256: more processes, a larger global batch.
    optimizer, scaler = build_optimizer(model_without_ddp, args, amp_dtype)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    extra = Extras()
    if args.ema or args.mixup_alpha or args.cutmix_alpha or args.bn_recalibrate or ctx.device.type == "cuda":
        extra = extras.training_extras(model, model_without_ddp, optimizer, split, args, ctx)  # and a CUDA graph
    progress = Progress(last_epoch=budget.most_epochs(args) if args.time_budget else args.epochs or DEFAULT_EPOCHS)
    if checkpoint:  # every rank the same optimizer state; a stopped epoch goes on after its last step
        progress = resume.restore_training(checkpoint, progress, optimizer, scaler, extra, train_loader,
                                           dropped_some_files, args, ctx)
    ctx.print0(f"training: epoch {progress.epoch + 1} of {progress.last_epoch}, {len(train_loader)} batches a process")
    tensorboard = SummaryWriter(output_dir) if ctx.is_main else None  # its writer thread is torch's
    if ctx.is_main:  # config.json, class_indices.json, split.json
        write_run_files(output_dir, args, plan.launcher, split, data_root, ctx, progress)

    # From here a SIGTERM (SLURM's warning, scancel, torchrun passing one on) is a request: every rank stops after
    # the same step of training or evaluation, rank 0 saves the position, every process exits 75. Before, it ends
    # the process at once (nothing to save); after the last epoch's evaluation, nothing reads it.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    for epoch in range(progress.epoch + 1, progress.last_epoch + 1):
        if args.time_budget and not budget.next_epoch_fits(progress, epoch, train_loader, output_dir, args, ctx):
            break  # broadcast: rank 0's clock decides for every rank
        train_sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        # all_reduce: DDP's of the gradients in each backward(); every 20 steps (or 5 s), a small one (a NaN loss or a
        # SIGTERM on any rank stops them all); the epoch's loss and accuracy. broadcast: DDP's of rank 0's buffers.
        trained = train_one_epoch(model, criterion, optimizer, scaler, train_loader, epoch, progress, amp_dtype,
                                  args, ctx, extra, stop.is_set)
        # broadcast: rank 0's BatchNorm statistics, which every rank evaluates; all_reduce: each image once, and about
        # every 5 s whether a SIGTERM came.
        evaluated = None if trained.stopped else evaluate(model_without_ddp, val_loader, args, ctx, extra, stop.is_set,
                                                          trained.seconds_per_step)
        if trained.stopped or evaluated.stopped:  # SIGTERM: rank 0 saves the position; barrier; every process exits 75
            preemption.save_position_and_exit(model_without_ddp, optimizer, scaler, extra, progress, trained, epoch,
                                              split, output_dir, args, ctx)
        is_best = progress.finish_epoch(epoch, trained, evaluated)
        if ctx.is_main:  # rank 0 alone writes; the others go on to their next collective, and wait there
            record = epoch_record(epoch, trained, evaluated, split, args, ctx)
            print(epoch_line(record, progress.last_epoch, is_best), flush=True)
            write_epoch(output_dir, record, tensorboard)  # metrics.jsonl and TensorBoard, before the checkpoint
            # torch.save to a temporary file, renamed over last.pth (and best.pth first, when the epoch is the best).
            save_checkpoint(make_checkpoint(model_without_ddp, optimizer, scaler, progress, args, split.class_names,
                                            ctx.world_size, extra, evaluated), output_dir, is_best)
        if args.trace_collectives:  # rank 0 prints where the ranks met in this epoch
            collective_trace.print_epoch(epoch, output_dir, ctx)
    if args.report:  # barrier, all_gather, all_reduce, all_gather: best.pth's weights, class by class
        report.report_on_best(model_without_ddp, val_loader, split, output_dir, args, ctx)
    if ctx.is_main:
        tensorboard.close()
        if args.scaling:  # what the processes bought: metrics.jsonl's epochs, DDP's timers
            scaling.report(output_dir, model, ctx)
        if args.plots:  # the curves, the classes, augmented samples and the report's pictures, as PNGs
            report.draw_plots(output_dir)
        print(f"done: best val_acc {progress.best_acc:.4f}; checkpoints and logs in {output_dir}", flush=True)


if __name__ == "__main__":
    main()
