"""What the experiments measure and record with: step timing, memory from /proc, the machine
and command of a result, and writing the result."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import PIL
import torch
import torchvision

from plots import figure_class
from utils import UserError, cpu_count, list_images

ROOT = Path(__file__).resolve().parent.parent  # the repository: where the launchers are, and its git state
# Reading a process's PSS walks its page tables: ~30 ms for a 1.5 GB training process here. Every
# 3 s keeps the sampler's CPU time near 1% of one core, so it does not slow what it watches.
MEMORY_SAMPLE_SECONDS = 3.0
PLOT_DPI = 110


# --------------------------------------------------------------------------- time

class StepTimer:
    """Hands `count` batches to a training loop and times each step: from taking one batch to
    taking the next, so a step is the loop's own work plus any wait for the loader. On CUDA the
    marks are events, so the times are the device's and the loop needs no extra sync."""

    def __init__(self, batches: Iterable, count: int, device: torch.device):
        self.batches = batches
        self.count = count
        self.cuda = device.type == "cuda"
        self.host_marks: list[float] = []
        self.events: list[torch.cuda.Event] = []
        self.requested = 0.0

    def __len__(self) -> int:
        return self.count  # train_one_epoch reads it for its last-step check and progress bar

    def __iter__(self) -> Iterator:
        self.requested = time.perf_counter()  # before iter(loader): an epoch's start-up counts from here
        for _, batch in zip(range(self.count), self.batches):
            self._mark()
            yield batch
        self._mark()

    def first_batch_seconds(self) -> float:
        """From asking for the batches to having the first: starting (or refilling) the loader workers."""
        return self.host_marks[0] - self.requested

    def _mark(self) -> None:
        self.host_marks.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def step_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in itertools.pairwise(self.events)]
        return [b - a for a, b in itertools.pairwise(self.host_marks)]


def rank_rate(step_seconds: list[float], warmup: int, batch_size: int) -> float:
    """Images/s of one process over its steps after the warm-up."""
    steady = step_seconds[warmup:]
    return batch_size * len(steady) / sum(steady)


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values (every repetition of a measurement failed)."""
    values = list(values)
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------- data

def sized_folder(source: str, images: int, target: Path) -> tuple[int, int]:
    """`target` with `images` pictures in `source`'s class folders and proportions: hard links
    to its pictures, each repeated as often as needed. Returns (pictures in source, repeats of
    the most repeated). Repeated pictures fall on both sides of the split: a folder for timing,
    not for accuracy."""
    class_names, samples = list_images(source)
    if images < len(class_names):
        raise UserError(f"--images {images} is fewer than the {len(class_names)} classes")
    by_class = {c: [p for p, label in samples if label == c] for c in range(len(class_names))}
    most, before = 0, 0
    for c, name in enumerate(class_names):
        # Rounded cumulatively, so that the counts add up to `images` exactly.
        count = round((before + len(by_class[c])) * images / len(samples)) - round(before * images / len(samples))
        before += len(by_class[c])
        folder = target / name
        folder.mkdir(parents=True)
        for k, path in enumerate(itertools.islice(itertools.cycle(by_class[c]), count)):
            repeat = k // len(by_class[c])
            most = max(most, repeat + 1)
            link = folder / f"{Path(path).stem}-{repeat}{Path(path).suffix}"
            try:
                os.link(path, link)
            except OSError:  # another file system
                shutil.copyfile(path, link)
    return len(samples), most


@contextlib.contextmanager
def data_of_size(source: str, images: int) -> Iterator[tuple[str, int]]:
    """(folder, pictures in `source`): `source` itself for `images` 0, else a temporary folder
    of `images` pictures made of hard links to its pictures (sized_folder), removed afterwards."""
    if not images:
        yield source, len(list_images(source)[1])
        return
    with tempfile.TemporaryDirectory() as tmp:
        pictures, repeats = sized_folder(source, images, Path(tmp))
        print(f"{images} images from {pictures} pictures (each used up to {repeats} times) in {tmp}", flush=True)
        yield tmp, pictures


# --------------------------------------------------------------------------- memory

def vm_hwm_mb() -> float:
    """The kernel's high-water mark of this process's resident memory (getrusage's ru_maxrss
    would also count the parent's memory at the moment it started this process)."""
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(entry.path, "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    return children


def _pss_mb(pid: int) -> float:
    """Proportional set size: shared pages (libraries, copy-on-write memory of forked loader
    workers, the shared-memory cache) are split among the processes that map them, so a sum
    over processes counts each page once."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024
    return 0.0


class MemorySampler(threading.Thread):
    """Samples the summed PSS of some processes and all their descendants (loader workers)."""

    def __init__(self, roots: list[int]):
        super().__init__(daemon=True)
        self.roots = roots
        self.samples: list[tuple[float, float]] = []  # (time.time(), MiB)
        self.done = threading.Event()
        self.cpu_seconds = 0.0

    def run(self) -> None:
        wait = 1.0  # a first look soon, so that even a short run has one
        while not self.done.wait(wait):
            wait = MEMORY_SAMPLE_SECONDS
            started = time.thread_time()
            children = _children_map()
            tree, todo = [], list(self.roots)
            while todo:
                pid = todo.pop()
                tree.append(pid)
                todo.extend(children.get(pid, []))
            self.samples.append((time.time(), sum(_pss_mb(p) for p in tree)))
            self.cpu_seconds += time.thread_time() - started

    def stop(self) -> None:
        self.done.set()
        self.join()

    def peak(self, span: tuple[float, float] | None = None) -> float | None:
        values = [mb for t, mb in self.samples if span is None or span[0] <= t <= span[1]]
        return round(max(values), 1) if values else None


# --------------------------------------------------------------------------- the record of a run

def command_line() -> str:
    """The command as a user types it. Under `python -m`, sys.argv[0] is the path of
    __main__.py, which nobody types: the package's name stands in for it."""
    return shlex.join(["python", "-m", __package__, *sys.argv[1:]])


def machine_info(name: str | None) -> dict[str, Any]:
    """The hardware and software a result was measured on; `name` labels it in plots."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info = {
        "name": name or f"{cpu_count()}-core {model}" + (f", {gpu}" if gpu else ", no GPU"),
        "cpu_model": model,
        "cpu_flags_of_note": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
        "cores": os.cpu_count(),
        "usable_cores": cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": gpu,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "python": platform.python_version(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if gpu:
        info.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), gpu_driver=gpu_driver())
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = ["git", "-C", str(ROOT)]
        info["git_commit"] = subprocess.check_output([*git, "rev-parse", "HEAD"], text=True).strip()
        dirty = subprocess.check_output([*git, "status", "--porcelain", "--untracked-files=no"], text=True).split("\n")
        info["git_modified_files"] = [line[3:] for line in dirty if line.strip()]
    return info


def gpu_driver() -> str | None:
    """The NVIDIA driver's version, as nvidia-smi reports it."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.check_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       text=True).split("\n")[0].strip()
    return None


class Run:
    """One experiment's run, from its start: the head of its result (what ran, where, and how
    loaded the machine was), so that every result can be judged and repeated."""

    def __init__(self, benchmark: str, machine: str | None):
        self.benchmark = benchmark
        self.machine = machine
        self.started = time.time()
        self.load_start = os.getloadavg()

    def result(self, settings: dict[str, Any], *, definitions: dict[str, str] | None = None,
               started_at: bool = False, **body: Any) -> dict[str, Any]:
        """The result: this head, then `body`. `started_at` adds the start's local time (the
        throughput results have it; the others have not, and keep the fields they had)."""
        result: dict[str, Any] = {"benchmark": self.benchmark, "command": command_line(),
                                  "machine": machine_info(self.machine), "settings": settings}
        if definitions is not None:
            result["definitions"] = definitions
        result["load_average"] = {"start": self.load_start, "end": os.getloadavg()}
        if started_at:
            result["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started))
        result["wall_seconds"] = round(time.time() - self.started, 1)
        return {**result, **body}


def write_result(result: dict[str, Any], out: str, report: str,
                 plot: Callable[[dict[str, Any], Path], None] | None = None) -> None:
    """Write `result` as JSON to `out` and, given `plot`, a PNG of the same name next to it;
    then print `report` (a markdown table) and where the files went."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    written = [path]
    if plot is not None:
        png = path.with_suffix(".png")
        png.unlink(missing_ok=True)  # an earlier result's picture: this one's, or none (nothing to draw, no matplotlib)
        plot(result, png)
        if png.exists():
            written.append(png)
    print(report)
    print("wrote " + " and ".join(map(str, written)))


def new_figure(width: float, height: float) -> Any:
    """A matplotlib Figure (rendered without pyplot), or None, saying so, where matplotlib is not installed."""
    Figure = figure_class()
    if Figure is None:
        print("matplotlib is not installed: no plot")
        return None
    return Figure(figsize=(width, height), layout="constrained")
