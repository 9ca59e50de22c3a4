"""Train ResNet34 with DistributedDataParallel, processes started by torch.multiprocessing.spawn.

    python train_multi_gpu_using_spawn.py --data-path dataset/flower_photos          # one per GPU
    python train_multi_gpu_using_spawn.py --world-size 2 --data-path data/flower_photos_sample

No launcher needed: this script starts the processes itself, on this machine only, and picks a
free port on 127.0.0.1 unless MASTER_ADDR/MASTER_PORT are set. On a machine without GPUs,
--world-size N runs N CPU processes with gloo. See README.md for every option.
"""
import os
import signal
import sys

import torch
import torch.multiprocessing as mp

from multi_train_utils.check import check
from multi_train_utils.config import Plan, get_args_parser, prepare
from multi_train_utils.distributed_utils import (
    STOP_GRACE_SECONDS,
    Rendezvous,
    forward_signal,
    host_store,
    keep_gloo_on_loopback,
    parse_device,
    parse_dist_url,
    resolve_device,
    stop,
    teardown,
)
from multi_train_utils.run import run
from utils import ProjectError, UserError, exit_on_error, stderr_line


def worker(rank: int, plan: Plan, world_size: int, store_address: tuple[str, int]) -> None:
    with exit_on_error():
        try:
            rdzv = Rendezvous(rank, rank, world_size, world_size, store_address)
            if plan.args.check:
                sys.exit(check(plan, rdzv))
            run(plan, rdzv.join(plan.args.device, plan.args.backend, plan.args.dist_timeout))
        except ProjectError:
            raise
        except Exception as e:
            # mp.spawn shows the traceback of one failed process, the first it notices: often a
            # rank that only lost its peer. Each rank's own line keeps the first cause on screen.
            stderr_line(f"rank {rank}: {type(e).__name__}: {e}")
            raise
        finally:
            teardown()


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


if __name__ == "__main__":
    main()
