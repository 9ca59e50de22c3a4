#!/usr/bin/env bash
# The GPU measurements and checks of docs/performance.md and docs/troubleshooting.md, as run on a
# lent GPU machine in calls of under ten minutes (`bash benchmarks/gpu_session.sh 1`, then `... 2`
# in the first loan; `3`, then `4`, in the second; `5` in the third; `6` next; `7`, then `8`,
# after the launchers' rewrite; `9` after the core's, 2d3466f): each step is cut by its own time limit, so that
# a call ends inside its lease, and each writes its result under $OUT as it finishes (parts 3 and 4:
# the JSON results in $OUT/results.tar, refreshed after every step). DATA: the 800-photo
# development folder.
set -u
OUT=${OUT:-/tmp/gpu-session}
DATA=${DATA:-.gpudata/flower_photos_dev}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
step() { echo; echo "=== $(date +%T) $*"; }
# The GPU, its driver and clocks, the Python packages, the CPUs and the commit: each part's first step.
machine() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    $PY -c "import sys, torch, torchvision; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda',
torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'nccl', torch.cuda.nccl.version(), 'torchvision',
torchvision.__version__)"
    lscpu | grep -E '^(Model name|CPU\(s\))'
    git log -1 --format=%h 2>/dev/null
}

if [ "$1" = 1 ]; then
    step "machine"
    machine 2>&1 | tee "$OUT/machine.txt"

    step "the GPU tests of the graphed step and of nvJPEG"
    timeout 110 $PY -m pytest tests/test_gpu.py -v -p no:cacheprovider --timeout 90 \
        -k "graph or replayed or nvjpeg or device_augment" 2>&1 | tail -25

    step "throughput at batch 16: eager and graphed, on the GPU alone and through the loader"
    timeout 100 $PY -m benchmarks throughput --data-path "$DATA" --images 10000 --world-sizes 1 --batch-size 16 \
        --steps 100 --warmup 10 --repeats 1 --configs ours-eager ours-graph --out "$OUT/throughput-b16.json" 2>&1 \
        | grep -v Warning | tail -8

    step "the whole job: 10 epochs of a flower_photos-sized folder, the defaults and the eager step"
    timeout 90 $PY -m benchmarks endtoend --data-path "$DATA" --images 3670 --epochs 10 --batch-size 16 --repeats 1 --no-seed-recipe \
        --variant '' --variant '--cuda-graph off' --out "$OUT/endtoend.json" 2>&1 | grep -v Warning | tail -8

    step "start-up decoding: nvJPEG against the CPU's threads"
    timeout 30 $PY -m benchmarks decode --data-path "$DATA" --out "$OUT/decode.json" 2>&1 | grep -v Warning | tail -4

    step "--check under torchrun with NCCL"
    timeout 35 torchrun --nproc_per_node=1 train_multi_gpu_using_launch.py --data-path "$DATA" --check 2>&1 | tail -20

    step "NCCL: the one worker of torchrun killed in its second epoch"
    rm -rf /tmp/killed
    (timeout 45 torchrun --nproc_per_node=1 train_multi_gpu_using_launch.py --data-path "$DATA" --epochs 50 \
        --img-size 64 --output-dir /tmp/killed > /tmp/killed.log 2>&1; echo "torchrun exit code $?" >> /tmp/killed.log) &
    job=$!
    for _ in $(seq 30); do grep -q "^epoch 1/" /tmp/killed.log && break; sleep 1; done
    # The worker: the first process of the script with torchrun's LOCAL_RANK (its loader workers come later).
    worker=$($PY -c "
import os
pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]
def has(pid, what, text):
    try:
        return text in open(f'/proc/{pid}/{what}', 'rb').read()
    except OSError:
        return False
print(min(p for p in pids if has(p, 'cmdline', b'train_multi_gpu_using_launch.py') and has(p, 'environ', b'LOCAL_RANK=')))")
    killed=$($PY -c "import time; print(time.time())"); kill -9 "$worker"; wait $job
    grep -v "^ *$" /tmp/killed.log | tail -25
    $PY -c "import time; print(f'ended {time.time() - $killed:.1f} s after the SIGKILL of process $worker')"
fi

if [ "$1" = 2 ]; then
    step "the whole job: 10 epochs of a flower_photos-sized folder, larger batches"
    timeout 200 $PY -m benchmarks endtoend --data-path "$DATA" --images 3670 --epochs 10 --batch-size 16 --repeats 1 --no-seed-recipe \
        --variant '--batch-size 256 --device-augment' \
        --variant '--batch-size 64 --device-augment' --out "$OUT/endtoend.json" 2>&1 | grep -v Warning | tail -12

    step "throughput at batch 64 and 256, eager and graphed, real JPEGs"
    for b in 256 64; do
        timeout 100 $PY -m benchmarks throughput --data-path "$DATA" --images 10000 --world-sizes 1 --batch-size $b \
            --repeats 1 --no-synthetic --configs ours-eager ours-graph --out "$OUT/throughput-b$b.json" 2>&1 \
            | grep -v Warning | tail -6
    done

    step "NCCL: two processes on the one GPU"
    timeout 60 torchrun --nproc_per_node=2 train_multi_gpu_using_launch.py --data-path "$DATA" --epochs 1 \
        --img-size 64 --output-dir /tmp/two 2>&1 | tail -12
fi

# Part 3: where the graphed step's time goes, the larger batches, the whole job with the best options.
R=/tmp/gpu-results
keep() { mkdir -p "$R"; tar -cf "$OUT/results.tar" -C "$R" . ; }
if [ "$1" = 3 ]; then
    mkdir -p "$R"
    step "machine"
    machine 2>&1 | tee "$R/machine.txt"; keep

    step "the step of 16 profiled: graphed (the default), eager, graphed in NCHW"
    for v in "graph:" "eager:--cuda-graph off" "graph-nchw:--no-channels-last"; do
        timeout 35 $PY -m benchmarks profile --data-path "$DATA" --batch-size 16 --steps 30 --warmup 20 \
            --options="${v#*:}" --out "$R/profile-b16-${v%%:*}.json" 2>&1 | grep -v Warning | tail -14; keep
    done

    step "throughput at batch 256 on random tensors: the original recipe, eager, graphed, compiled"
    timeout 120 $PY -m benchmarks throughput --data-path "$DATA" --images 10000 --world-sizes 1 --batch-size 256 \
        --steps 20 --warmup 5 --repeats 1 --no-real --configs seed ours-eager ours-graph ours-compile \
        --out "$R/throughput-b256.json" 2>&1 | grep -v Warning | tail -8; keep

    step "throughput at batch 64 (random tensors and real JPEGs), and 256 through the loader"
    timeout 55 $PY -m benchmarks throughput --data-path "$DATA" --images 10000 --world-sizes 1 --batch-size 64 \
        --steps 30 --warmup 10 --repeats 1 --configs ours-eager ours-graph --out "$R/throughput-b64.json" 2>&1 \
        | grep -v Warning | tail -6; keep
    timeout 40 $PY -m benchmarks throughput --data-path "$DATA" --images 10000 --world-sizes 1 --batch-size 256 \
        --steps 15 --warmup 5 --repeats 1 --no-synthetic --configs ours-graph --out "$R/throughput-b256-real.json" 2>&1 \
        | grep -v Warning | tail -6; keep

    step "the whole job, 10 epochs of 3,670 photos: the defaults, and batches of 256 and 64 with --device-augment"
    timeout 100 $PY -m benchmarks endtoend --data-path "$DATA" --images 3670 --epochs 10 --batch-size 16 --repeats 1 --no-seed-recipe \
        --variant '' --variant '--batch-size 256 --device-augment' --variant '--batch-size 64 --device-augment' \
        --out "$R/endtoend.json" 2>&1 | grep -v Warning | tail -12; keep
fi

# Part 4: the whole suite, pytest-xdist's workers each on 2 cores of their own (tests/conftest.py).
if [ "$1" = 4 ]; then
    step "the whole suite"
    started=$(date +%s)
    # Each test's result as it ends (-v, into $OUT), each failure's report as it happens
    # (PYTEST_FAILURES_LOG), each test cut at 240 s: a run cut off by the time limit still says
    # what failed and why.
    PYTEST_FAILURES_LOG="$OUT/suite-failures.txt" timeout "${SUITE_LIMIT:-300}" $PY -m pytest tests -v -n 8 \
        -p no:cacheprovider --timeout 240 --durations=25 > "$OUT/suite.txt" 2>&1
    grep -E "(FAILED|ERROR)" "$OUT/suite.txt" | tail -40; tail -30 "$OUT/suite.txt"
    echo "the suite took $(( $(date +%s) - started )) s"
fi

# Part 5: the collective recorder on NCCL; the README's GPU figures again, all on one GPU in one call.
if [ "$1" = 5 ]; then
    mkdir -p "$R"
    step "machine"
    machine 2>&1 | tee "$R/machine.txt"; keep

    step "--trace-collectives under torchrun with NCCL"
    timeout 120 $PY -m pytest tests/test_gpu.py -v -s -p no:cacheprovider --timeout 110 -k "recorder" 2>&1 \
        | tee "$R/recorder-nccl.log" | tail -40; keep

    step "the whole job, 10 epochs of 3,670 photos: the defaults, the eager step, batch 256 with the data on the GPU"
    timeout 200 $PY -m benchmarks endtoend --data-path "$DATA" --images 3670 --epochs 10 --batch-size 16 --repeats 1 --no-seed-recipe \
        --variant '' --variant '--cuda-graph off' --variant '--batch-size 256 --device-augment --cache' \
        --out "$R/endtoend.json" 2>&1 | grep -v Warning | tee "$R/endtoend.log" | tail -12; keep

    step "throughput at batch 256, real JPEGs: the original recipe, the defaults, --compile"
    timeout 190 $PY -m benchmarks throughput --data-path "$DATA" --images 10000 --world-sizes 1 --batch-size 256 \
        --steps 30 --warmup 10 --repeats 1 --no-synthetic --configs seed ours ours-compile \
        --out "$R/throughput-b256.json" 2>&1 | grep -v Warning | tee "$R/throughput.log" | tail -10; keep
fi

# Part 6: the time to the original scripts' accuracy, the original recipe and ours in one call
# (10 epochs of 3,670 photos each; on an H100 the original took 77.6 s, ours 42.7 s).
if [ "$1" = 6 ]; then
    step "time to the original's 10-epoch accuracy: the seed recipe beside the defaults"
    timeout 400 $PY -m benchmarks endtoend --data-path "$DATA" --images 3670 --epochs 10 --batch-size 16 \
        --repeats 1 --variant '' --out "$OUT/endtoend-to-target.json" 2>&1 | grep -v Warning | tail -12
fi

# Part 7: after the launchers' rewrite (torch's own rendezvous and process group): every GPU test,
# a breakpoint on each of the nine steps in a default torchrun run on the GPU (NCCL, the graphed
# step), and the 10-epoch job beside the original recipe, in one call; each result into $OUT.
if [ "$1" = 7 ]; then
    step "machine"
    machine 2>&1 | tee "$OUT/machine.txt"

    # The GPU tests but the four slowest to start processes (part 8): all 22 take about 400 s there.
    step "the GPU tests, but the four of part 8"
    timeout 240 $PY -m pytest tests/test_gpu.py -v -p no:cacheprovider --timeout 150 --durations=8 \
        -k "not (throughput or recorder or nccl_stages or sigterm)" > "$OUT/gpu-tests.log" 2>&1
    grep -E "(PASSED|FAILED|ERROR|passed|failed)" "$OUT/gpu-tests.log" | tail -30

    step "a breakpoint on each line of the nine steps: torchrun's defaults on the GPU (tests/breakpoints/)"
    rm -rf /tmp/bp; mkdir -p /tmp/bp/reached
    BREAKPOINTS=$(cd tests && $PY -c "from test_distributed import step_lines
print(';'.join(f'{p}:{l}' for _, _, p, l in step_lines()))") || exit 1
    PYTHONPATH=tests/breakpoints BREAKPOINTS="$BREAKPOINTS" BREAKPOINTS_OUT=/tmp/bp/reached timeout 90 \
        torchrun --nproc_per_node=1 train_multi_gpu_using_launch.py --data-path data/flower_photos_sample \
        --epochs 3 --output-dir /tmp/bp/run > "$OUT/breakpoints.log" 2>&1; echo "torchrun exit code $?" | tee -a "$OUT/breakpoints.log"
    grep -E "^(precision|epoch 3/3)" "$OUT/breakpoints.log" | head -5
    (cd tests && $PY -c "
import pathlib
from test_distributed import reached_by_rank, step_lines
reached = reached_by_rank(pathlib.Path('/tmp/bp/reached'))
for step, call, path, line in step_lines():
    print(f'{step:26} {path.name}:{line:<4} {call:50} ranks {sorted(k for k, v in reached.items() if f\"{path}:{line}\" in v)}')
") 2>&1 | tee "$OUT/breakpoints.txt"

    step "time to the original's 10-epoch accuracy: the seed recipe beside the defaults"
    timeout 200 $PY -m benchmarks endtoend --data-path "$DATA" --images 3670 --epochs 10 --batch-size 16 \
        --repeats 1 --variant '' --out "$OUT/endtoend.json" 2>&1 | grep -v Warning | tee "$OUT/endtoend.log" | tail -12
fi

# Part 8: the other four GPU tests: the throughput benchmark, the recorder and --check on NCCL,
# SIGTERM to torchrun under NCCL with the default loader workers.
if [ "$1" = 8 ]; then
    timeout 300 $PY -m pytest tests/test_gpu.py -v -p no:cacheprovider --timeout 110 --durations=5 \
        -k "throughput or recorder or nccl_stages or sigterm" 2>&1 | tee "$OUT/gpu-tests-rest.log"
fi

# Part 9: after the core's rewrite (2d3466f), each GPU path the benchmarks take through it, short (no figure of
# docs/ measured again): the seed, the graphed and the eager step in the throughput experiment (the graph made
# once by training_extras, as the launchers make it), the graphed step profiled, the whole job with the
# defaults and with --device-augment, nvJPEG's decoding, and a start-up stopped by SIGTERM and resumed. About
# 6 minutes; each result into $OUT.
if [ "$1" = 9 ]; then
    step "machine"
    machine 2>&1 | tee "$OUT/machine.txt"

    step "throughput at batch 16: the seed, graphed, eager; random tensors and real JPEGs"
    timeout 150 $PY -m benchmarks throughput --data-path "$DATA" --world-sizes 1 --batch-size 16 --steps 20 \
        --warmup 10 --repeats 1 --configs seed ours-graph ours-eager --out "$OUT/throughput.json" 2>&1 \
        | grep -v Warning | tail -8

    step "the step of 16 profiled: graphed (the default)"
    timeout 60 $PY -m benchmarks profile --data-path "$DATA" --batch-size 16 --steps 20 --warmup 10 \
        --out "$OUT/profile.json" 2>&1 | grep -v Warning | tail -14

    step "the whole job, 2 epochs of 800 photos: the defaults and --device-augment"
    timeout 120 $PY -m benchmarks endtoend --data-path "$DATA" --images 800 --epochs 2 --batch-size 16 --repeats 1 \
        --no-seed-recipe --variant '' --variant=--device-augment --out "$OUT/endtoend.json" 2>&1 \
        | grep -v Warning | tail -8

    step "start-up decoding: nvJPEG against the CPU's threads"
    timeout 30 $PY -m benchmarks decode --data-path "$DATA" --out "$OUT/decode.json" 2>&1 | grep -v Warning | tail -4

    step "start-up: to the first step, stopped by SIGTERM once the run takes it as a request, and resumed"
    timeout 60 $PY -m benchmarks startup --data-path "$DATA" --images 800 --img-size 64 --out "$OUT/startup.json" 2>&1 \
        | grep -v Warning | tail -6
fi
