"""What a reader must read to follow the default torchrun run, measured on a real one: 2 gloo
processes on 60 photos, 2 epochs at 64 px, every other option at its default (the loader workers
on). tests/default_run/sitecustomize.py records, in every process of the job, each
project function's first call, each collective with the project frames that led to it, and each
thread or process that project code started; tests/default_run/count.py counts the lines (every
function that ran, whole; the module-level statements that ran) and lists what breaks the limits.

By hand: python tests/default_run/count.py TRACE_DIR."""
from __future__ import annotations

import os
import re
import sys
import time

import pytest
from conftest import REPO, copy_sample, ok, run_cli

from default_run.count import (LAUNCHER, collective_violations, count, read_trace, report, size_violations,
                               start_violations, table)


@pytest.mark.slow
def test_the_default_run_reads_in_few_lines(tmp_path):
    photos = copy_sample(tmp_path / "photos", per_class=12)  # 60 photos, 12 in each of 5 classes
    trace_dir = tmp_path / "trace"
    env = {
        # The tracer first: Python imports the first `sitecustomize` on the path, in every process.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "default_run"), str(REPO),
                                                    os.environ.get("PYTHONPATH")])),
        "DEFAULT_RUN_TRACE": str(trace_dir),
        "DEFAULT_RUN_ROOT": str(REPO),
        "OMP_NUM_THREADS": "1",  # 2 processes, one math thread each
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", LAUNCHER,
           "--data-path", str(photos), "--epochs", "2", "--img-size", "64", "--output-dir", str(tmp_path / "out")]
    began = time.perf_counter()
    ok(run_cli(cmd, timeout=300, env=env))
    print(f"traced run: {time.perf_counter() - began:.1f} s")

    trace = read_trace(trace_dir)
    counted = count(trace, REPO)
    print(report(trace, counted, LAUNCHER))
    assert LAUNCHER in counted.per_file(), "the trace did not see the launcher run"
    assert counted.total > 0

    # At most 1,000 lines in at most 10 files:
    assert not size_violations(counted, max_lines=1000, max_files=10), table(counted)
    # Every collective: the launcher's frames, then at most one project function below the launcher,
    # which may itself call one helper of multi_train_utils/distributed_utils.py named for its collective:
    assert not collective_violations(trace, LAUNCHER)
    # No thread or process that project code started outlives the project frame that started it, unless
    # that frame is the launcher's (the DataLoader's workers and fork server, TensorBoard's and tqdm's threads:
    # the libraries' own):
    assert not start_violations(trace, LAUNCHER)
    # The tour shows the figures as they are.
    assert tour_table() == counted.per_file(), (tour_table(), table(counted))


def tour_table() -> dict[str, int]:
    """docs/how-it-works.md's table of what a default run executes: file -> lines."""
    text = (REPO / "docs" / "how-it-works.md").read_text()
    section = text.split("## What a default run executes", 1)[1].split("\n## ", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^\| ([\w/]+\.py) \| (\d+) \|$", section, flags=re.M)}
