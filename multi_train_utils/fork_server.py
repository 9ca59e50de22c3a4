"""Imported first by the fork server the DataLoader forks its workers from on CPython before
3.11.10 (loader_options): the server leaves a SIGTERM sent to the whole job to the training
process, as its workers do, and ends the moment the training process ends, however it ends (its
workers, which hold it open, then end within seconds: torch's watchdog sees their parent gone)."""
import ctypes
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a SIGKILL when the training process ends
