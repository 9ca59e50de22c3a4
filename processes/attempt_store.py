"""Under torchrun, a store of this attempt's own, where the process group forms.

torchrun's agents keep one store for the whole job and hand it to every attempt's workers
(the c10d rendezvous shares its store with them unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1;
the static rendezvous of `--nnodes=1` always does), and no key in it is cleared when they
restart the workers. The keys gloo and NCCL write while a group forms (each rank's address)
stay there, and a restarted rank may read the previous attempt's address before this
attempt's rank 0 has written its own: it then connects to a closed port and fails
("connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712). So rank 0 of each
attempt hosts a new store on a free port of its machine and posts its port, with a token, in
the agent's store; the others take it from there, and a post of an earlier attempt (a port
closed now, or one whose store holds another token) is read again until this attempt's comes.
Nothing written in the new store outlives the attempt: it ends with rank 0.
"""
from __future__ import annotations

import os
import secrets
import time

import torch.distributed as dist

from processes.rendezvous import (Rendezvous, RendezvousIncomplete, greeted_store, port_unreachable,
                                          store_listening_on, under_torchrun)

POST = "flower-ddp/attempt-store"  # "PORT TOKEN", in the agent's store


def needed(rdzv: Rendezvous) -> bool:
    """Whether this process met the others at torchrun's agent's store, which is kept from one
    attempt to the next (without the agent's store, torch's env:// has rank 0 host one, anew)."""
    return rdzv.store_address is None and under_torchrun() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_store(agent_store: dist.Store, rank: int, where: str, timeout_s: float) -> tuple[str, dist.Store]:
    """This attempt's store, and where it is ("HOST:PORT"): on the machine of `where`, the
    agent's store (MASTER_ADDR, rank 0's machine under torchrun)."""
    host = where.rsplit(":", 1)[0]
    if rank == 0:
        store = store_listening_on(host, 0, timeout_s)
        token = secrets.token_hex(8)
        store.set("token", token)
        agent_store.set(POST, f"{store.port} {token}")
        return f"{host}:{store.port}", store
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agent_store.wait([POST])
        port, token = agent_store.get(POST).decode().split()
        if (store := _store_holding(host, int(port), token)) is not None:
            return f"{host}:{port}", store
        time.sleep(0.2)  # an earlier attempt's post: this attempt's rank 0 has yet to write its own
    raise RendezvousIncomplete(f"rank {rank}: rank 0 of this attempt posted no store at {host} in {timeout_s:g}s, "
                               "only an earlier attempt's: is rank 0 still starting?")


def _store_holding(host: str, port: int, token: str) -> dist.Store | None:
    """A client of the store at host:port if it is the one that posted `token`, else None."""
    if port_unreachable(host, port) is not None:
        return None
    try:
        store = greeted_store(host, port, timeout_s=5)
        store.wait(["token"])
        return store if store.get("token").decode() == token else None
    except Exception:  # an unrelated program on that port now, or a store that ended meanwhile
        return None
