"""What a reader must read to follow the default torchrun run, measured on a real one: 2 gloo
processes on 60 photos, 2 epochs at 64 px, every other option at its default (the loader workers
and the plots on). tests/default_run/sitecustomize.py records, in every process of the job, each
project function's first call, each collective with the project frames that led to it, and each
thread or process that project code started; tests/default_run/count.py counts the lines (every
function that ran, whole; the module-level statements that ran) and lists what breaks the limits.

By hand: python tests/default_run/count.py TRACE_DIR."""
from __future__ import annotations

import os
import sys
import time

import pytest
from conftest import REPO, copy_sample, ok, run_cli

from default_run.count import (LAUNCHER, collective_violations, count, read_trace, report, size_violations,
                               start_violations)


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

    # LIMITS: the main session turns these into asserts (`assert not ...`) once the code is reshaped.
    # At most 1,000 lines in at most 10 files:
    print("size:", size_violations(counted, max_lines=1000, max_files=10))
    # Every collective: the launcher's frames, then at most one project function below the launcher,
    # which may itself call one helper in multi_train_utils/distributed_utils.py:
    print("collectives:", collective_violations(trace, LAUNCHER))
    # No thread or process that project code started outlives the project frame that started it,
    # unless that frame is the launcher's (DataLoader's workers and TensorBoard's threads exempt):
    print("threads and processes:", start_violations(trace, LAUNCHER))
