"""Imported first by the fork server that prepare_helper_start() (distributed_utils.py) starts, and by
nothing else: the server then ends the moment the training process that started it ends, and
its children, the loader workers and plotters, with it (each of them asks for that of its own
parent: die_with_parent). Without it, a training process that is SIGKILLed leaves the server
and its workers running for ever: each worker holds the server's liveness pipe open, and
torch's watchdog in a worker watches the worker's parent, which is the server.

A SIGTERM sent to the whole job (SLURM, `kill -TERM -PGID`) is the training process's to act
on: the server ignores it, or the next loader worker it should fork would fail the run. It starts
with SIGTERM blocked (prepare_helper_start), and ignore_sigterm drops one that came meanwhile and
keeps it so for the server's children."""
from processes.helper_signals import die_with_parent, ignore_sigterm

die_with_parent()
ignore_sigterm()
