"""Where the processes of a job meet, before a process group exists: who each process is
(torchrun's or SLURM's environment), the store they meet at, and the waiting for the missing,
said by name. `setup_process_group()` in distributed_utils.py goes through here to
`dist.init_process_group`.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import time
import urllib.parse

import torch.distributed as dist

from utils import ProjectError, UserError, stderr_line

# A job waiting at the rendezvous says so after this many seconds, and again at this interval.
JOIN_REPORT_SECONDS = 30
FIRST_JOIN_REPORT_SECONDS = 5


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Who this process is in its job and where the job meets, before it has met."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    store_address: tuple[str, int] | None = None  # the spawn launcher's store; None: MASTER_ADDR/MASTER_PORT

    def address(self) -> tuple[str, int]:
        return self.store_address or master_address()

    def hosts_store(self) -> bool:
        """This process listens for the others (rank 0 of a job started without torchrun's agent)."""
        return self.store_address is None and self.rank == 0 and not agent_hosts_store()


class RendezvousIncomplete(ProjectError):
    """Some processes of the job never joined (or never reached the store) in time: exit code 1."""


def env_store(rank: int, world_size: int, timeout_s: float, report_every_s: float) -> tuple[str, int, dist.Store]:
    """The store that init_method="env://" would open, namespaced by torchrun's restart count.

    torchrun keeps one store for the whole job. After a worker dies and the group restarts,
    the new processes would otherwise find the addresses that the failed group published
    under the same keys, and hang or fail to connect to processes that no longer exist.
    """
    host, port = master_address()
    # Under torchrun the agent hosts the store and every worker is a client; otherwise rank 0 hosts it.
    if rank == 0 and not agent_hosts_store():
        # Not waiting for the others here: wait_for_ranks does, and says who is missing.
        try:
            store = dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except dist.DistNetworkError as e:
            raise UserError(f"cannot listen on {host}:{port} ({str(e).rsplit('message: ', 1)[-1]}): is MASTER_PORT "
                            "used by another job?") from None
    else:
        store = connect_store(host, port, rank, timeout_s, report_every_s)
    return host, port, dist.PrefixStore(f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def master_address() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, as torchrun or the job script set them."""
    try:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise UserError("MASTER_ADDR and MASTER_PORT must be set to the rendezvous address") from None


def agent_hosts_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def connect_store(host: str, port: int, rank: int, timeout_s: float, report_every_s: float) -> dist.Store:
    """A client of the store at host:port, once the port answers. A process that cannot reach it
    says so at intervals, on its own line (rank 0, which prints the job's lines, may be the
    one missing), and names the address once `timeout_s` has passed."""
    started = time.monotonic()
    next_report = started + min(FIRST_JOIN_REPORT_SECONDS, report_every_s)
    while (problem := port_unreachable(host, port)) is not None:
        waited = time.monotonic() - started
        where = f"rank {rank} on {socket.gethostname()} cannot reach the rendezvous at {host}:{port} ({problem})"
        if waited >= timeout_s:
            raise RendezvousIncomplete(f"{where} after {timeout_s:g}s: is rank 0 (or torchrun on the first node) "
                                       "started, the address right and the port open? The same command with "
                                       "--check tells")
        if time.monotonic() >= next_report:
            stderr_line(f"{where} after {waited:.0f}s; still trying")
            next_report += report_every_s
        time.sleep(0.2)
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def port_unreachable(host: str, port: int, timeout_s: float = 1.0) -> str | None:
    """Why a TCP connection to host:port fails (refused, timed out, no such host), or None."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror as e:
        return f"the name does not resolve: {e.strerror}"
    except OSError as e:
        return e.strerror or type(e).__name__


def wait_for_ranks(store: dist.Store, rank: int, world_size: int, local_world_size: int, where: str,
                   timeout_s: float, report_every_s: float) -> None:
    """Mark this process as arrived; on rank 0, wait until all have, saying who is missing at
    intervals and naming them once `timeout_s` has passed. init_process_group would wait in
    silence, and time out without a name."""
    store.set(f"joined/{rank}", socket.gethostname())
    joined = store.add("joined", 1)
    if rank != 0:
        return
    started = time.monotonic()
    next_report = started + min(FIRST_JOIN_REPORT_SECONDS, report_every_s)
    while joined < world_size:
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise RendezvousIncomplete(f"{waiting_line(store, world_size, local_world_size, where)} after "
                                       f"{timeout_s:g}s: run the same command with --check (on each node) to find why")
        if time.monotonic() >= next_report:
            print(f"waiting: {waiting_line(store, world_size, local_world_size, where)} ({waited:.0f}s so far; "
                  "the same command with --check diagnoses the setup)", flush=True)
            next_report += report_every_s
        time.sleep(0.1)
        joined = store.add("joined", 0)


def waiting_line(store: dist.Store, world_size: int, local_world_size: int, where: str) -> str:
    """"1 of 2 processes joined at HOST:PORT; missing: rank 1", the missing read from the store."""
    missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
    return (f"{world_size - len(missing)} of {world_size} processes joined at {where}; missing: "
            f"{missing_ranks(missing, world_size, local_world_size)}")


def missing_ranks(missing: list[int], world_size: int, local_world_size: int, most: int = 8) -> str:
    """"rank 3 (node 1)": the node where the usual layout (consecutive ranks per node, as torchrun
    and srun place them) would put it, when there are several nodes."""
    several_nodes = local_world_size < world_size
    names = [f"rank {r}" + (f" (node {r // local_world_size})" if several_nodes else "") for r in missing[:most]]
    more = f" and {len(missing) - most} more" if len(missing) > most else ""
    return ", ".join(names) + more


def env_ranks(local_rank_arg: int | None = None) -> tuple[int, int, int, int] | None:
    """(rank, local_rank, world_size, local_world_size) from torchrun or SLURM, else None.

    torchrun and `torch.distributed.launch --use_env` export RANK/LOCAL_RANK/WORLD_SIZE; the
    legacy launcher without --use_env passes --local-rank instead of LOCAL_RANK. Under `srun`
    one task is one process, described by SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS; the rendezvous
    address must then come from MASTER_ADDR/MASTER_PORT (see the sbatch script in docs/multi-node.md).
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", local_rank_arg if local_rank_arg is not None else 0))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        return int(env["RANK"]), local_rank, world_size, local_world_size
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise UserError(
                f"running under SLURM but {' and '.join(missing)} is not set: export the first "
                "node's address and a free port in the sbatch script (see docs/multi-node.md, SLURM)"
            )
        world_size = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", "1"))
        local_world_size = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or max(
            1, world_size // nodes
        )
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), world_size, local_world_size
    return None


def parse_dist_url(url: str) -> tuple[str, int] | None:
    """`--dist-url` (the original scripts' init_method): None for env://, else (host, port)."""
    if url == "env://":
        return None
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or not port:
        raise UserError(f"--dist-url {url!r} is not env:// or tcp://HOST:PORT")
    return parts.hostname, port


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store for processes this one starts, listening on host:port only.

    Port 0 asks the OS for a free port while binding it, so two jobs started at the same
    moment cannot pick the same one (as "find a free port, then let rank 0 bind it" can).
    The socket is ours because TCPStore itself would listen on every interface.
    """
    try:
        sock = socket.create_server((host, port), backlog=128)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): is MASTER_PORT used by another job?") from None
    return dist.TCPStore(
        host, sock.getsockname()[1], None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=sock.detach(),
    )


def keep_gloo_on_loopback(host: str) -> str | None:
    """Point gloo at the loopback interface when the rendezvous is on loopback, so that the
    processes of a one-machine job connect over it and nothing listens beyond the machine.
    Returns the interface it chose, or None when it left the environment alone (set already,
    or a rendezvous elsewhere). Processes started afterwards inherit it."""
    if not host.startswith("127.") or "GLOO_SOCKET_IFNAME" in os.environ:
        return None
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    return loopback
