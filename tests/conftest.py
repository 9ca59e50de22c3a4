"""Helpers shared by the tests: run a launcher for real, read what it wrote, build odd image folders."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "data" / "flower_photos_sample"
sys.path.insert(0, str(REPO))

# Small and fast: 32 px crops still run the whole network, and 2 CPU cores finish an epoch
# of the 120-image sample in about a second.
FAST = ["--img-size", "32", "--batch-size", "8", "--workers", "0"]


def launcher_cmd(launcher: str, nproc: int = 1) -> list[str]:
    if launcher == "single":
        return [sys.executable, "train_single_gpu.py"]
    if launcher == "launch":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--standalone", "train_multi_gpu_using_launch.py"]
    if launcher == "spawn":
        return [sys.executable, "train_multi_gpu_using_spawn.py", "--world-size", str(nproc)]
    raise ValueError(launcher)


def run_cli(cmd: list[str], timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", **(env or {})}
    full_env.pop("MASTER_PORT", None)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


def train(launcher: str, out: Path, *extra: str, nproc: int = 1, data: Path = SAMPLE, timeout: float = 180,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = launcher_cmd(launcher, nproc) + ["--data-path", str(data), "--output-dir", str(out), *FAST, *extra]
    return run_cli(cmd, timeout=timeout, env=env)


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


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
