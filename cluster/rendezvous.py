"""Where the processes of a job meet when torchrun did not start them. srun starts each task on
its own (so does a user who sets RANK and WORLD_SIZE by hand), and torch's env:// rendezvous would
wait --dist-timeout for a missing one and name no one, or hang for as long on processes started
for different counts: here rank 0 hosts the store at MASTER_ADDR:MASTER_PORT, as env:// would,
names the missing every minute while it waits, and stops every rank at once, with one line, when
they count different processes. The spawn launcher starts its processes itself, on one machine:
it exports where they meet, and waits for them."""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import signal
import socket
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from multi_train_utils.config import parse_dist_url
from multi_train_utils.distributed_utils import Ranks
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


def job_store(ranks: Ranks, timeout_s: float, option: str = "--dist-timeout") -> dist.Store:
    """The store the job's process group meets at where torch's env:// would not do: a group that
    torchrun restarted on its own store; and where no torchrun agent gathered the processes (srun's
    tasks, or processes given RANK and WORLD_SIZE by hand), rank 0's, at MASTER_ADDR:MASTER_PORT.
    Rank 0 waits there for every rank as long as `option` says (the others connect, retrying, as
    long), naming the missing every minute, and checks that every rank counts the same processes;
    each rank learns its verdict. A SIGTERM meanwhile ends the process at once: no handler is set
    before training."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if ranks.agent:  # a group torchrun restarted: the agent's store still holds the failed group's addresses, which
        # torch's env:// would read again (pytorch/pytorch#135712); this attempt's keys go under a prefix of its own.
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"restart-{ranks.restart}", store)
    try:
        store = dist.TCPStore(host, port, ranks.world_size, is_master=ranks.rank == 0, timeout=timeout,
                              wait_for_workers=False)
    except dist.DistError as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise ProjectError(f"rank {ranks.rank} on {socket.gethostname()}: no rendezvous at {host}:{port} within "
                           f"{timeout_s:.0f} s ({why}): is rank 0 running there, and is the port free and open?") from None
    store.set(f"joined/{ranks.rank}", str(ranks.world_size))
    if ranks.rank == 0:
        verdict = joined_verdict(store, ranks.world_size, timeout_s, f"{host}:{port}", option)
        store.set("verdict", verdict)
        if verdict:  # the others read it from rank 0's store, which ends with rank 0: a few seconds for them
            joined = [r for r in range(1, ranks.world_size) if store.check([f"joined/{r}"])]
            with contextlib.suppress(dist.DistError):
                store.wait([f"read/{r}" for r in joined], datetime.timedelta(seconds=10))
            raise ProjectError(verdict)
        return store
    try:  # rank 0 gives its verdict once its own wait is over: a little longer here, or the two race
        store.wait(["verdict"], timeout + datetime.timedelta(seconds=30))
        verdict = store.get("verdict").decode()
        store.set(f"read/{ranks.rank}", "")
    except dist.DistError:
        raise ProjectError(f"rank {ranks.rank}: rank 0 ended the rendezvous (its own line says why)") from None
    if verdict:
        raise ProjectError(f"rank 0 ended the rendezvous: {verdict}")
    return store


def joined_verdict(store: dist.TCPStore, world_size: int, timeout_s: float, where: str, option: str) -> str:
    """Rank 0's wait at the rendezvous: "" once every rank has joined, counting `world_size`
    processes as rank 0 does; else why not, as soon as it is known."""
    waited = 0.0
    while True:
        joined = {r: int(store.get(f"joined/{r}")) for r in range(world_size) if store.check([f"joined/{r}"])}
        if others := {r: n for r, n in joined.items() if n != world_size}:
            r, n = next(iter(others.items()))
            return (f"rank {r} was started for {n} processes (WORLD_SIZE, SLURM_NTASKS), rank 0 for {world_size}: "
                    "start every process with the same count")
        missing = [r for r in range(world_size) if r not in joined]
        if not missing:
            return ""
        names = ", ".join(f"rank {r}" for r in missing[:8]) + (" and more" if len(missing) > 8 else "")
        if waited >= timeout_s:
            return (f"{world_size - len(missing)} of {world_size} processes joined at {where} within "
                    f"{timeout_s:.0f} s ({option}); missing: {names}")
        if waited and waited % 60 < 1:
            print(f"rendezvous: waited {waited / 60:.0f} min at {where} for {names}", flush=True)
        step = min(1.0, timeout_s - waited)  # short waits: a rank that joins with another count is named at once
        try:
            store.wait([f"joined/{r}" for r in missing], datetime.timedelta(seconds=step))
        except dist.DistError:
            pass
        waited += step


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


def end_with_the_started(signum: int, frame: Any) -> None:
    """The spawn launcher's SIGTERM handler while mp.spawn starts its processes: passed on to those
    started (at start-up, it ends them at once: nothing to save), and this process ends as the signal
    would have ended it; left running, it would wait on for a process that never reads its plan."""
    for process in mp.active_children():
        os.kill(process.pid, signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


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
