#!/usr/bin/env bash
# The GPU measurements and checks of docs/performance.md and docs/troubleshooting.md, as run on a
# lent GPU machine in two calls of about seven minutes (`bash benchmarks/gpu_session.sh 1`, then `... 2`): each step is
# cut by its own time limit, so that a call ends inside its lease, and each writes its result
# under $OUT as it finishes. DATA: the 800-photo development folder.
set -u
OUT=${OUT:-/tmp/gpu-session}
DATA=${DATA:-.gpudata/flower_photos_dev}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
step() { echo; echo "=== $(date +%T) $*"; }

if [ "$1" = 1 ]; then
    step "machine"
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      $PY -c "import sys, torch, torchvision; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda',
torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'nccl', torch.cuda.nccl.version(), 'torchvision',
torchvision.__version__)"
      lscpu | grep -E '^(Model name|CPU\(s\))'; } 2>&1 | tee "$OUT/machine.txt"

    step "the GPU tests of the graphed step and of nvJPEG"
    timeout 110 $PY -m pytest tests/test_gpu.py -v -p no:cacheprovider --timeout 90 \
        -k "graph or replayed or nvjpeg or device_augment" 2>&1 | tail -25

    step "throughput at batch 16: eager and graphed, on the GPU alone and through the loader"
    timeout 100 $PY -m benchmarks throughput --data-path "$DATA" --images 10000 --world-sizes 1 --batch-size 16 \
        --steps 100 --warmup 10 --repeats 1 --configs ours-eager ours-graph --out "$OUT/throughput-b16.json" 2>&1 \
        | grep -v Warning | tail -8

    step "the whole job: 10 epochs of a flower_photos-sized folder, the defaults and the eager step"
    timeout 90 $PY -m benchmarks endtoend --data-path "$DATA" --images 3670 --epochs 10 --batch-size 16 --repeats 1 \
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
    timeout 200 $PY -m benchmarks endtoend --data-path "$DATA" --images 3670 --epochs 10 --batch-size 16 --repeats 1 \
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
