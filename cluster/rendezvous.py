"""Where the processes of a job meet when torchrun did not start them. srun starts each task on
its own, and torch's env:// rendezvous would wait --dist-timeout for a missing one and name no
one: here rank 0 hosts the store at MASTER_ADDR:MASTER_PORT, as env:// would, and names the
missing every minute while it waits. The spawn launcher starts its processes itself, on one
machine: it exports where they meet, and waits for them."""
from __future__ import annotations

import datetime
import inspect
import os
import signal
import socket
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from multi_train_utils.distributed_utils import Ranks
from multi_train_utils.config import parse_dist_url
from utils import ProjectError, UserError, stderr_line


def srun_ranks() -> Ranks | None:
    """Who this process is, where srun started it: one task, one process (SLURM_PROCID,
    SLURM_LOCALID, SLURM_NTASKS); the job script exports MASTER_ADDR and MASTER_PORT. None where
    srun did not start it."""
    env = os.environ
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise UserError(f"running under SLURM but {' and '.join(missing)} is not set: export the first "
                        "node's address and a free port in the job script (flowers.sbatch does)")
    world_size, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
    per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or max(1, world_size // nodes)
    return Ranks(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), world_size, per_node, srun_task=True)


def srun_store(ranks: Ranks, timeout_s: float) -> dist.TCPStore:
    """The store the job's process group meets at: rank 0's, which waits for every rank as long
    as --dist-timeout (the others connect, retrying, as long). A SIGTERM meanwhile ends the
    process at once: no handler is set before training."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, ranks.world_size, is_master=ranks.rank == 0, timeout=timeout,
                              wait_for_workers=False)
    except dist.DistError as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise ProjectError(f"rank {ranks.rank} on {socket.gethostname()}: no rendezvous at {host}:{port} within "
                           f"{timeout_s:.0f} s ({why}): is rank 0 running there, and is the port free and open?") from None
    store.set(f"joined/{ranks.rank}", socket.gethostname())
    waited = 0.0
    while ranks.rank == 0:
        missing = [r for r in range(ranks.world_size) if not store.check([f"joined/{r}"])]
        if not missing:
            break
        names = ", ".join(f"rank {r}" for r in missing[:8]) + (" and more" if len(missing) > 8 else "")
        if waited >= timeout_s:
            raise ProjectError(f"{ranks.world_size - len(missing)} of {ranks.world_size} processes joined at "
                               f"{host}:{port} within {timeout_s:.0f} s (--dist-timeout); missing: {names}")
        if waited:
            print(f"rendezvous: waited {waited / 60:.0f} min at {host}:{port} for {names}", flush=True)
        step = min(60.0, timeout_s - waited)
        try:
            store.wait([f"joined/{r}" for r in missing], datetime.timedelta(seconds=step))
        except dist.DistError:
            pass
        waited += step
    return store


def meeting_point(args: Any) -> None:
    """Where the spawn launcher's processes meet, exported for them: --dist-url, else MASTER_ADDR
    and MASTER_PORT, else a free port on 127.0.0.1; on loopback, gloo stays there too."""
    host, port = parse_dist_url(args.dist_url) or (os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                                    int(os.environ.get("MASTER_PORT", "0")))
    if not port:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
    if (host.startswith("127.") or host == "::1") and "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
            print(f"GLOO_SOCKET_IFNAME={loopback} (gloo stays on loopback)")


def join_processes(context: Any, grace_seconds: float = 5) -> int:
    """Wait for the processes of an mp.spawn `context`; the job's exit code. Once one has failed,
    torch's join gives the others `grace_seconds` to end by themselves, then SIGTERM, as long
    again, then SIGKILL. A SIGTERM to this process alone (a scheduler that signals the main
    process) is passed on to them; Ctrl-C ends them all (130)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: [os.kill(p.pid, signal.SIGTERM)
                                                         for p in context.processes if p.is_alive()])
    # torch 2.5's join has no grace period: it sends SIGTERM at once (then SIGKILL 30 s later).
    grace = {"grace_period": grace_seconds} if "grace_period" in inspect.signature(context.join).parameters else {}
    try:
        while not context.join(timeout=1, **grace):
            pass
    except mp.ProcessExitedException as e:
        # The process printed its own line unless a signal gave it no chance to.
        if e.signal_name:
            stderr_line(f"error: process {e.error_index} was killed by {e.signal_name}")
            return 128 + getattr(signal, e.signal_name, 0)
        return e.exit_code
    except mp.ProcessRaisedException as e:
        stderr_line(str(e))  # the failing rank's traceback
        return 1
    except KeyboardInterrupt:
        for p in context.processes:
            p.terminate()
        for p in context.processes:
            p.join(grace_seconds)
            if p.is_alive():
                p.kill()
        stderr_line("interrupted")
        return 130
    return 0
