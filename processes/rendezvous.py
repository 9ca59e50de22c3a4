"""Where the processes of a job meet, before a process group exists: who each process is
(torchrun's or SLURM's environment), the store they meet at, and, where no torchrun agent has
gathered them already, the waiting for the missing, said by name. `init_distributed()` in
distributed_utils.py goes through here to `dist.init_process_group`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import os
import socket
import threading
import time
import urllib.parse

import torch.distributed as dist

from utils import ProjectError, UserError, stderr_line

# A job waiting at the rendezvous says so after this many seconds, and again at this interval.
JOIN_REPORT_SECONDS = 30
FIRST_JOIN_REPORT_SECONDS = 5
# Seconds a store's port may take to answer the store's greeting: a program that is not a store
# (a port taken by something else) may accept the connection and never answer.
GREETING_SECONDS = 10
# The key where rank 0 says whether the job is whole ("go") or why it will not start.
WORD, GO = "rendezvous-word", "go"
MISMATCH = "the processes disagree"
CHECK_ADVICE = ": run the same command with --check (on each node) to find why"


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
        """This process listens for the others (rank 0 of a job that neither torchrun nor the spawn
        launcher started: srun's)."""
        return self.store_address is None and self.rank == 0 and not under_torchrun()


class RendezvousIncomplete(ProjectError):
    """Some processes of the job never joined (or never reached the store) in time: exit code 1."""

    by_rank_0 = False  # True where this process learned it from rank 0's word, not by itself
    word = ""  # then, rank 0's word


class RendezvousMismatch(RendezvousIncomplete):
    """The processes disagree on who they are: the world size, or two claiming one rank."""


def meeting_store(rdzv: Rendezvous, timeout_s: float, report_every_s: float,
                  advice: str = CHECK_ADVICE) -> tuple[str, dist.Store]:
    """Where the processes of the job meet ("HOST:PORT") and the store they meet at.

    Under torchrun, its agents have gathered every process of this attempt already, given each
    its rank, and host the store: torch's own env:// rendezvous gives that store, namespaced by
    torch, and nothing is waited for here. Otherwise the processes were started one by one
    (srun, or the spawn launcher), and a process of a wrong count or a missing one would leave
    init_process_group waiting in silence: each says who it is in the store (rank 0's, or the
    spawn launcher's), and rank 0 says "go" once the job is whole, or names what is wrong
    (wait_for_ranks). Such a store lives as long as this job, so no key outlives it."""
    if rdzv.store_address is None and under_torchrun():
        host, port = master_address()
        store, _, _ = next(dist.rendezvous("env://", rdzv.rank, rdzv.world_size,
                                           timeout=datetime.timedelta(seconds=timeout_s)))
        return f"{host}:{port}", store
    host, port = rdzv.address()
    if rdzv.hosts_store():
        # Not waiting for the others here: wait_for_ranks does, and says who is missing.
        if problem := not_local_problem(host, socket.gethostname()):
            # An address that reaches this machine only through NAT (a Kubernetes Service, a
            # Docker port mapping) is right; another machine's is not, and the others then wait.
            stderr_line(f"warning: {problem}; if it reaches this machine through NAT (a Kubernetes Service, a "
                        "Docker port mapping), that is right, and the store listens on every interface")
            try:
                store = dist.TCPStore("127.0.0.1", port, rdzv.world_size, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=timeout_s))
            except dist.DistNetworkError as e:
                raise UserError(f"cannot listen on port {port} ({str(e).rsplit('message: ', 1)[-1].strip()}): "
                                "is MASTER_PORT used by another job?") from None
        else:
            store = store_listening_on(host, port, timeout_s)  # on that address alone, loopback's too
    else:
        store = connect_store(host, port, rdzv.rank, timeout_s, report_every_s)
    wait_for_ranks(store, rdzv.rank, rdzv.world_size, rdzv.local_world_size, f"{host}:{port}", timeout_s,
                   report_every_s, advice, store_host(rdzv))
    return f"{host}:{port}", store


def store_host(rdzv: Rendezvous) -> str:
    """Which process hosts the job's store, as the messages name it."""
    if rdzv.store_address is not None:
        return "the spawn launcher"
    return "torchrun's agent on the first node" if under_torchrun() else "rank 0"


def under_torchrun() -> bool:
    """Whether torchrun's agent (or the legacy launcher, which runs it) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def not_local_problem(host: str, machine: str) -> str | None:
    """Why rank 0 cannot host the store at `host`: it names no address of this machine. Found by
    binding a socket to it, which fails here and sends nothing; None when it binds."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"MASTER_ADDR {host} does not resolve on {machine} ({e.strerror})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((address[0], 0))
                return None
            except OSError:
                continue
    return (f"MASTER_ADDR {host} is not an address of this machine, {machine}, where rank 0 runs and hosts the "
            "rendezvous; if it is another machine's, set it to this one's (`hostname -I`), or start rank 0 on the "
            "machine it names")


def master_address() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, as torchrun or the job script set them."""
    try:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise UserError("MASTER_ADDR and MASTER_PORT must be set to the rendezvous address") from None


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
    return greeted_store(host, port, timeout_s)


def greeted_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the store at host:port, which answers. TCPStore's greeting waits without a
    bound for a program that accepts the connection and says nothing (a port another program
    holds): it waits here on a thread of its own, for GREETING_SECONDS."""
    box: dict[str, object] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # DistNetworkError: a wrong answer to the greeting
            box["error"] = e

    greeting = threading.Thread(target=connect, name="store greeting", daemon=True)
    greeting.start()
    greeting.join(GREETING_SECONDS)
    if "store" in box:
        return box["store"]  # type: ignore[return-value]
    if "error" in box:
        why = (f"gave a wrong answer to the rendezvous store's greeting ({str(box['error']).splitlines()[0]}): "
               "another program holds that port, or it runs another version of torch's store")
    else:
        why = (f"gave no answer in {GREETING_SECONDS}s to the rendezvous store's greeting: another program holds "
               "that port, or the store's host is stuck")
    raise RendezvousIncomplete(f"{host}:{port} accepts connections, but {why}. Choose another MASTER_PORT "
                               "(--master-port), the same on every node, and look at rank 0's output")


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
                   timeout_s: float, report_every_s: float, advice: str = CHECK_ADVICE,
                   store_host: str = "rank 0") -> None:
    """Each process says who it believes it is: its rank, the world size it was given, its
    machine. Rank 0 waits until the job is whole, saying who is missing at intervals, then says
    "go", or why the job will not start: processes that disagree on the world size, two that
    claim one rank, or the missing, named once `timeout_s` has passed (`advice` added). The others
    wait for that word, so every process ends with the cause. init_process_group would wait in
    silence (a process told of a larger world, forever), and time out without a name."""
    store.append("arrivals", f"{rank} {world_size} {socket.gethostname()};")
    if rank != 0:
        word = word_of_rank_0(store, rank, where, timeout_s, report_every_s, store_host)
        store.add("word-read", 1)
        if word != GO:
            error = (RendezvousMismatch if word.startswith(MISMATCH) else RendezvousIncomplete)(
                f"rank {rank} on {socket.gethostname()}: rank 0 stopped the job at the rendezvous: {word}")
            error.by_rank_0, error.word = True, word
            raise error
        return
    started = time.monotonic()
    next_report = started + min(FIRST_JOIN_REPORT_SECONDS, report_every_s)
    while True:
        arrived = arrivals(store)
        problem = disagreement(arrived, world_size)
        if problem:
            say_to_all(store, problem, len(arrived) - 1)
            raise RendezvousMismatch(problem)
        if {r for r, _, _ in arrived} >= set(range(world_size)):
            store.set(WORD, GO)
            return
        waited = time.monotonic() - started
        line = waiting_line(arrived, world_size, local_world_size, where)
        if waited >= timeout_s:
            say_to_all(store, f"{line} after {timeout_s:g}s (rank 0's output says more)", len(arrived) - 1)
            raise RendezvousIncomplete(f"{line} after {timeout_s:g}s{advice}")
        if time.monotonic() >= next_report:
            hint = "; the same command with --check diagnoses the setup" if advice else ""
            print(f"waiting: {line} ({waited:.0f}s so far{hint})", flush=True)
            next_report += report_every_s
        time.sleep(0.1)


def say_to_all(store: dist.Store, word: str, others: int, wait_s: float = 10.0) -> None:
    """Rank 0's word why the job will not start, left in the store until the `others` that have
    arrived read it (a few seconds at most): rank 0 hosts the store, which ends with it."""
    store.set(WORD, word)
    until = time.monotonic() + wait_s
    while store.add("word-read", 0) < others and time.monotonic() < until:
        time.sleep(0.05)


def word_of_rank_0(store: dist.Store, rank: int, where: str, timeout_s: float, report_every_s: float,
                   store_host: str = "rank 0") -> str:
    """What rank 0 says once it has seen every process: "go", or why not. Waiting for it is right
    while processes are missing; this one says so every `report_every_s` seconds (rank 0 names
    the missing). Rank 0 gives up at `timeout_s`; a little later this one does too."""
    started = time.monotonic()
    next_report = started + max(report_every_s, JOIN_REPORT_SECONDS)  # rank 0's lines come first, and name the missing
    host = socket.gethostname()
    try:
        while not store.check([WORD]):
            waited = time.monotonic() - started
            if waited >= timeout_s + FIRST_JOIN_REPORT_SECONDS:
                raise RendezvousIncomplete(f"rank {rank} on {host} joined at {where}, but rank 0 said nothing in "
                                           f"{waited:.0f}s: is it running? Its output says why not")
            if time.monotonic() >= next_report:
                stderr_line(f"rank {rank} on {host}: joined at {where}, waiting for rank 0 to see every process "
                            f"({waited:.0f}s so far)")
                next_report += max(report_every_s, JOIN_REPORT_SECONDS)
            time.sleep(0.1)
        return store.get(WORD).decode()
    except dist.DistNetworkError:
        raise RendezvousIncomplete(f"rank {rank} on {host}: the rendezvous at {where} went away while this process "
                                   f"waited for rank 0 ({store_host} hosts it: did it end? Its output says why)") from None


def arrivals(store: dist.Store) -> list[tuple[int, int, str]]:
    """(rank, world size, machine) of each process that has arrived, in order of arrival."""
    text = store.get("arrivals").decode() if store.check(["arrivals"]) else ""
    return [(int(r), int(w), machine) for r, w, machine in (entry.split(" ", 2) for entry in text.split(";") if entry)]


def disagreement(arrived: list[tuple[int, int, str]], world_size: int) -> str | None:
    """Why the processes that arrived cannot make one job of `world_size` processes (rank 0's
    count), or None."""
    other = [(r, w, machine) for r, w, machine in arrived if w != world_size]
    if other:
        r, w, machine = other[0]
        return (f"{MISMATCH} on the world size: rank 0 was started for {world_size} processes, rank {r} on {machine} "
                f"for {w}: start every process with the same count (torchrun's --nnodes and --nproc_per_node on "
                "every node, srun's --ntasks, or WORLD_SIZE), then start the job again")
    machines: dict[int, str] = {}
    for r, _, machine in arrived:
        if r in machines:
            return (f"{MISMATCH} on who is who: two processes claim rank {r} (on {machines[r]} and {machine}): give "
                    f"each process its own rank, 0 to {world_size - 1} (RANK, or SLURM_PROCID under srun)")
        machines[r] = machine
    outside = sorted(r for r in machines if not 0 <= r < world_size)
    if outside:
        return (f"{MISMATCH} on who is who: rank {outside[0]} (on {machines[outside[0]]}) is outside a job of "
                f"{world_size} processes (ranks 0 to {world_size - 1}): give each process its own rank below the "
                "world size")
    return None


def waiting_line(arrived: list[tuple[int, int, str]], world_size: int, local_world_size: int, where: str) -> str:
    """"1 of 2 processes joined at HOST:PORT; missing: rank 1"."""
    joined = {r for r, _, _ in arrived}
    missing = [r for r in range(world_size) if r not in joined]
    return (f"{world_size - len(missing)} of {world_size} processes joined at {where}; missing: "
            f"{missing_ranks(missing, world_size, local_world_size)}")


def missing_ranks(missing: list[int], world_size: int, local_world_size: int, most: int = 8) -> str:
    """"rank 3 (node 1)": the node where the usual layout (consecutive ranks per node, as torchrun
    and srun place them) would put it, when there are several nodes."""
    several_nodes = local_world_size < world_size
    names = [f"rank {r}" + (f" (node {r // local_world_size})" if several_nodes else "") for r in missing[:most]]
    more = f" and {len(missing) - most} more" if len(missing) > most else ""
    return ", ".join(names) + more


def env_ranks(local_rank_arg: int | None = None) -> Rendezvous | None:
    """Who this process is, from torchrun's or SLURM's environment; None when neither started it.

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
        return Rendezvous(int(env["RANK"]), local_rank, world_size, local_world_size)
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
        return Rendezvous(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), world_size, local_world_size)
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


def host_store(args: argparse.Namespace) -> dist.TCPStore:
    """The rendezvous store for the processes the spawn launcher starts: at --dist-url
    tcp://HOST:PORT, else at MASTER_ADDR/MASTER_PORT, else on 127.0.0.1 at a free port (all its
    processes run on this machine, so by default nothing listens beyond loopback, and gloo stays
    on loopback too: keep_gloo_on_loopback). Listening on host:port only.

    Port 0 asks the OS for a free port while binding it, so two jobs started at the same
    moment cannot pick the same one (as "find a free port, then let rank 0 bind it" can).
    The socket is ours because TCPStore itself would listen on every interface.
    """
    host, port = parse_dist_url(args.dist_url) or (os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                                    int(os.environ.get("MASTER_PORT", "0")))
    store = store_listening_on(host, port, args.dist_timeout)
    if loopback := keep_gloo_on_loopback(host):
        print(f"GLOO_SOCKET_IFNAME={loopback} (gloo stays on loopback)")
    return store


def store_listening_on(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on host:port (0: a free port), on that address alone when it is one
    (loopback's included); for a host name, on every interface, as torch's own store listens: a
    machine may resolve its own name to an address the others cannot reach (127.0.1.1)."""
    try:
        every_interface = ipaddress.ip_address(host) is None  # an address: that one alone
    except ValueError:
        every_interface = host != "localhost"  # a name
    try:
        if not every_interface:
            sock = socket.create_server((host, port), backlog=128)
        elif socket.has_dualstack_ipv6():
            sock = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
        else:
            sock = socket.create_server(("", port), backlog=128)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): is MASTER_PORT used by another job (or a "
                        "second process started as rank 0)?") from None
    return dist.TCPStore(
        "127.0.0.1" if every_interface else host, sock.getsockname()[1], None, is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=sock.detach(),
        use_libuv=False,  # torch 2.5's default backend, libuv, cannot take over a listening socket
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


def socket_interface_problem(backend: str) -> str | None:
    """Why GLOO_SOCKET_IFNAME (gloo) or NCCL_SOCKET_IFNAME (nccl) names no network interface of
    this machine, or None. gloo takes exact names, comma-separated; NCCL takes prefixes, exact
    names after `=`, and exclusions after `^` (not checked)."""
    variable = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}.get(backend)
    value = os.environ.get(variable or "", "")
    if not value or value.startswith("^"):
        return None
    present = [name for _, name in socket.if_nameindex()]
    wanted = [name for name in value.removeprefix("=").split(",") if name]
    if backend == "gloo":
        absent = [name for name in wanted if name not in present]
    else:
        exact = value.startswith("=")
        found = any(p == w if exact else p.startswith(w) for w in wanted for p in present)
        absent = [] if found else wanted
    if not absent:
        return None
    return (f"{variable}={value} names no network interface of {socket.gethostname()} (it has "
            f"{', '.join(present)}): set it to the interface on the network the other machines reach (`ip addr` "
            "lists them), the same name on every machine, or unset it")
