"""Helpers shared by the tests: run a launcher for real, watch and stop its processes, read what
it wrote, build odd image folders.

Tests that start processes (launchers, process groups, benchmarks, a `--help`) or train a
run are marked `slow`; `python -m pytest tests -m "not slow" -n auto` runs the rest in under a minute."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
# The project's packages, in the order of tests/test_layout.py's layers, lowest first.
PACKAGES = ("multi_train_utils", "recipe", "speed", "outputs", "cluster", "benchmarks")
SAMPLE = REPO / "data" / "flower_photos_sample"
sys.path.insert(0, str(REPO))

from multi_train_utils.config import get_args_parser  # noqa: E402 -- importable from here on
from my_dataset import MyDataSet, build_transform  # noqa: E402
from utils import list_images  # noqa: E402

# Small and fast: 32 px crops still run the whole network, and 2 CPU cores finish an epoch
# of the 120-image sample in about a second. The PNGs would take longer than that: the tests
# that look at them ask for --plots.
FAST = ["--img-size", "32", "--batch-size", "8", "--workers", "0", "--no-plots"]
# The same with the default loader workers (CPUs per process - 1, at least one), which start
# processes of their own: the configuration users run, for the tests of signals and faults.
FAST_DEFAULT_WORKERS = [arg for arg in FAST if arg not in ("--workers", "0")]
# For the tests of processes, signals and files, where the network is any network: ResNet18
# (11.7M parameters, 90 MB checkpoints) trains an epoch twice as fast as ResNet34 (21.8M, 170
# MB), and it still learns at a batch of 2, where the smallest torchvision models' BatchNorm
# statistics blow up or their outputs collapse to a constant. The end-to-end runs of each
# launcher, the exactness of evaluation, the original command lines and the tests of the model,
# of each recipe option, of predict and export keep ResNet34, the default, and its layout. Here
# the layout is NCHW: at 2-8 images of 32 px a channels_last step spends most of its time
# copying each weight's gradient into the weight's layout (profiled: 58% of a step of 2), a cost
# that the default sizes' arithmetic dwarfs; it made these runs 35% slower.
SMALL_MODEL = ["--model", "resnet18", "--no-channels-last"]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: starts processes or trains a run (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: runs on CUDA (tests/test_gpu.py); every other test's processes see no GPU")
    config.addinivalue_line("markers", "floor: the launchers' end-to-end runs and the collective recorder's, which "
                                       ".ci/run repeats on the oldest torch that requirements.txt allows "
                                       "(requirements-floor.txt)")
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # A shell starts a background job (`cmd &`, nohup) with Ctrl-C ignored, and every process
        # it starts inherits that: the tests that press Ctrl-C on a job would wait in vain.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if worker and cores:
        # `pytest -n N` (pytest-xdist): each worker and every process it starts keeps to its own
        # share of the cores, as on a small machine of its own, so that the jobs' threads and
        # loader workers, sized from the cores they see, do not pile up (OpenMP's threads spin
        # while they wait: two sets on one core slow each other several-fold). More workers than
        # cores (`-n 4` on 2) share a core, one math thread apiece, which do not spin.
        share = max(1, len(cores) // workers)
        index = int(worker.removeprefix("gw")) % (len(cores) // share)
        os.sched_setaffinity(0, cores[index * share:(index + 1) * share])
        torch.set_num_threads(share)  # this process's own pool was sized when conftest imported torch


@pytest.fixture(autouse=True)
def processes_on_the_cpu(request, monkeypatch) -> None:
    """The processes a test starts run on the CPU, whatever GPUs the machine has: the suite's
    multi-process jobs are gloo jobs of 2 or 3 processes on one machine, which on a machine with
    fewer GPUs than processes would (rightly) be refused. Only the `gpu` tests see the GPUs."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        # The same for the code a test runs in this process: CUDA, once this process has asked
        # (the gpu tests' skip marks ask at collection), no longer reads CUDA_VISIBLE_DEVICES,
        # and the launchers' default device would be the GPU.
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# The files whose real jobs take longest (docs/performance.md#the-test-suite), in that order. The
# README's command (-n auto --dist loadfile --no-loadscope-reorder) hands whole files to the
# workers in the order collected: these first, so that no long file starts while the other
# workers run out of files (xdist's own order, most tests first, handed out the SLURM file last).
LONGEST_FIRST = ["test_preemption.py", "test_slurm.py", "test_fault_matrix.py", "test_benchmark.py",
                 "test_multinode.py", "test_distributed.py", "test_resume_split.py", "test_collective_trace.py",
                 "test_faults.py", "test_compat.py", "test_check.py"]


def pytest_collection_modifyitems(items) -> None:
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file's tests keep theirs


def pytest_runtest_logreport(report) -> None:
    """With PYTEST_FAILURES_LOG=PATH, each failure's report is appended there as it happens
    (pytest's own summary comes only at the end, which a run cut off by a time limit never
    reaches: the GPU machine's runs)."""
    path = os.environ.get("PYTEST_FAILURES_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:  # once: xdist's controller
        with open(path, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when}, {report.duration:.0f} s)\n{report.longreprtext}\n")


def launcher_cmd(launcher: str, nproc: int = 1) -> list[str]:
    if launcher == "single":
        return [sys.executable, "train_single_gpu.py"]
    if launcher == "launch":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--standalone", "train_multi_gpu_using_launch.py"]
    if launcher == "spawn":
        return [sys.executable, "train_multi_gpu_using_spawn.py", "--world-size", str(nproc)]
    raise ValueError(launcher)


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a launcher in its own process group, as a shell starts a job."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    full_env.update(PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_cli(cmd: list[str], timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = start(cmd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        states = where_they_wait(group_of(proc))  # before the kill: which process waits where
        kill_group(proc)  # every process of the job, not only the launcher
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-3000:]}\n"
                             f"the job's processes then:\n{states}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def group_of(proc: subprocess.Popen) -> list[int]:
    """The live processes of `proc`'s process group (start() makes it the leader of its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[2]) == proc.pid and stat[0] != "Z":
                found.append(int(entry.name))
    return sorted(found)


def where_they_wait(pids: list[int]) -> str:
    """describe_processes(pids), and each one's Python stacks where py-spy is installed: what a
    test reports when a job hangs."""
    text = describe_processes(pids)
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    for pid in pids if spy else ():
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
            text += "\n" + "\n".join(line for line in dump.splitlines() if line.strip())
    return text


def train(launcher: str, out: Path, *extra: str, nproc: int = 1, data: Path = SAMPLE, timeout: float = 180,
          env: dict[str, str] | None = None, fast: list[str] = FAST) -> subprocess.CompletedProcess:
    cmd = launcher_cmd(launcher, nproc) + ["--data-path", str(data), "--output-dir", str(out), *fast, *extra]
    return run_cli(cmd, timeout=timeout, env=env)


def train_here(out: Path, *extra: str, data: Path = SAMPLE) -> subprocess.CompletedProcess:
    """train_single_gpu.py's main() in this process, its output and exit code as train() gives
    them: for the tests of what a run reads and records, where the process is not under test, it
    saves the 3 s an interpreter takes to import torch and torchvision."""
    import train_single_gpu

    argv = ["--data-path", str(data), "--output-dir", str(out), *FAST, *extra]
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    saved_env = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            call_main(train_single_gpu.main, argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        if saved_env is None:
            os.environ.pop("TQDM_DISABLE")
        else:
            os.environ["TQDM_DISABLE"] = saved_env
    return subprocess.CompletedProcess(["train_single_gpu.py", *argv], code, stdout.getvalue(), stderr.getvalue())


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    return result


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def copy_sample(dst: Path, classes: list[str] | None = None, per_class: int | None = None) -> Path:
    """A copy of (part of) the bundled sample that a test may change."""
    for class_dir in sorted(p for p in SAMPLE.iterdir() if p.is_dir()):
        if classes is not None and class_dir.name not in classes:
            continue
        (dst / class_dir.name).mkdir(parents=True)
        for f in sorted(class_dir.iterdir())[:per_class]:
            shutil.copy(f, dst / class_dir.name / f.name)
    return dst


def check_png(path, min_width: int = 400, min_height: int = 300) -> np.ndarray:
    """A real, non-blank picture of a sensible size; its pixels."""
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert min_width <= img.width <= 3000 and min_height <= img.height <= 3000, (path, img.size)
        pixels = np.asarray(img.convert("RGB"))
    assert pixels.std() > 10, f"{path} looks blank"
    return pixels


def call_main(main, argv: list[str]) -> None:
    """A script's main() in this process (no interpreter start-up), with `argv` as its command line."""
    old = sys.argv
    sigterm = signal.getsignal(signal.SIGTERM)  # a launcher's main() sets its own, for a process it then ends
    sys.argv = ["prog", *argv]
    try:
        main()
    finally:
        sys.argv = old
        signal.signal(signal.SIGTERM, sigterm)


def user_error(main, argv: list[str], capsys) -> str:
    """Run a launcher's main() in this process; check it ends with one `error:` line and exit
    code 2, without a traceback; return that line."""
    with pytest.raises(SystemExit) as exit_info:
        call_main(main, argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def processes_with_marker(marker: str) -> list[int]:
    """PIDs of live processes whose environment holds MARKER=marker: a job's launcher, its
    workers and their data-loader workers, whatever session or process group they are in."""
    needle = f"TEST_JOB_MARKER={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":  # a zombie has exited and only waits for its parent to reap it
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def describe_processes(pids: list[int]) -> str:
    """One line per process (pid, state, what the kernel has it waiting in, command line): what
    a test prints when a job stalls, to tell a deadlock from a slow machine."""
    lines = []
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            wchan = (proc / "wchan").read_text() or "-"
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            cpu_seconds = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
        lines.append(f"  pid {pid} state {stat[0]} in {wchan}, {cpu_seconds:.1f}s of CPU: {cmdline}")
    return "\n".join(lines)


# What "promptly" means for a job that must stop (the README promises it). torchrun's and
# mp.spawn's own escalation waits 30 s before SIGKILL.
STOP_WITHIN = 20


def start_job(launcher: str, out: Path, *extra: str, nproc: int = 2, data: Path = SAMPLE, max_restarts: int = 0,
              fast: list[str] = FAST):
    """A training job in the background, to be stopped, killed or restarted; `max_restarts`
    makes a torchrun job elastic; `fast=FAST_DEFAULT_WORKERS`: with the default loader workers."""
    marker = uuid.uuid4().hex
    cmd = launcher_cmd(launcher, nproc) + ["--data-path", str(data), "--output-dir", str(out), *fast, *SMALL_MODEL,
                                           *extra]
    if max_restarts:
        cmd.insert(cmd.index("--standalone"), f"--max-restarts={max_restarts}")
    proc = start(cmd, env={"TEST_JOB_MARKER": marker})
    proc.marker = marker
    return proc, marker


def wait_for_epochs(proc, out: Path, epochs: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= epochs):
        if proc.poll() is not None or time.monotonic() > deadline:
            marker = getattr(proc, "marker", None)  # set by start_job
            states = where_they_wait(processes_with_marker(marker) if marker else group_of(proc))
            kill_group(proc)
            stdout, stderr = proc.communicate()
            raise AssertionError(f"the job ended or stalled before epoch {epochs}:\n{states}\n"
                                 f"stdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-3000:]}")
        time.sleep(0.05)


def finished_after_killing_a_worker(proc, marker: str) -> str:
    """kill -9 one worker of an elastic torchrun job: torchrun restarts the group, which must
    resume and finish with nothing left running. Its stdout."""
    workers = child_pids(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout
    assert not processes_with_marker(marker)
    return stdout


def wait_until_gone(proc, marker: str) -> tuple[float, str]:
    """Seconds until the launcher exits and no process of the job is left; its stderr."""
    started = time.monotonic()
    try:
        _, err = proc.communicate(timeout=STOP_WITHIN)
        while processes_with_marker(marker) and time.monotonic() - started < STOP_WITHIN:
            time.sleep(0.1)
    finally:
        leftover = processes_with_marker(marker)
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        kill_group(proc)
    assert not leftover, f"processes left running: {leftover}"
    return time.monotonic() - started, err


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a job's MASTER_PORT or rendezvous endpoint (the
    launchers pick their own: only the spawn launcher, and only without MASTER_PORT)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def args_for(*argv: str) -> argparse.Namespace:
    """The launchers' options for the bundled sample, as parsed from `argv`."""
    return get_args_parser("test").parse_args(["--data-path", str(SAMPLE), *argv])


def sample_batch(count: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` real photos spread over the classes, as uint8 pixels (validation transform)."""
    _, samples = list_images(str(SAMPLE))
    picked = samples[:: len(samples) // count][:count]
    dataset = MyDataSet(picked, build_transform(size, train=False), size)
    images, labels = zip(*(dataset[i] for i in range(count)))
    return torch.stack(images), torch.tensor(labels)
