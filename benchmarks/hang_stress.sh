#!/usr/bin/env bash
# The stress run of the rare start-up hang (docs/troubleshooting.md, python/cpython#112275):
#   bash benchmarks/hang_stress.sh N [extra options...]      e.g.  bash benchmarks/hang_stress.sh 200 --cache
# runs the spawn job that once hung (tests/test_cache.py's, with --cache) N times, each under `timeout 120`. A
# run whose output has not grown for 60 s counts as a hang: each process of the job is described
# (threads, kernel wait channels, and Python stacks where py-spy is installed), then killed. The
# tally and the descriptions go under ${OUT:-runs/hang-stress}. One run takes about 10 s on 2 cores.
set -u
n=${1:?how many runs}; shift
out=${OUT:-runs/hang-stress}; PY=${PY:-python}
mkdir -p "$out"
descendants() { echo "$1"; for c in $(ps -o pid= --ppid "$1"); do descendants "$c"; done; }
describe() {  # describe RUN LAUNCHER_PID
    for p in $(descendants "$2"); do
        { echo "== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline)"
          for t in /proc/$p/task/*; do echo "  thread $(basename "$t") $(cat "$t/comm") wchan=$(cat "$t/wchan")"; done
          command -v py-spy > /dev/null && timeout 60 py-spy dump --pid "$p" --native
        } >> "$out/hang-$1.txt" 2>&1
    done
}
hangs=0
for i in $(seq "$n"); do
    log="$out/run.log"; rm -rf "$out/run"
    timeout 120 $PY train_multi_gpu_using_spawn.py --world-size 2 --data-path data/flower_photos_sample \
        --output-dir "$out/run" --img-size 48 --batch-size 8 --workers 1 --no-plots --model resnet18 --epochs 2 \
        "$@" > "$log" 2>&1 &
    job=$!; size=-1; quiet_since=$(date +%s); hung=0
    while kill -0 "$job" 2>/dev/null; do
        sleep 2
        now=$(date +%s); s=$(stat -c %s "$log")
        [ "$s" != "$size" ] && size=$s && quiet_since=$now
        if [ $((now - quiet_since)) -ge 60 ]; then
            hung=1; kill -STOP "$job"  # keep `timeout` from ending the job while it is described
            launcher=$(ps -o pid= --ppid "$job" | head -1)
            describe "$i" "$launcher"; cp "$log" "$out/hang-$i.out"
            for p in $(descendants "$launcher"); do kill -KILL "$p" 2>/dev/null; done
            kill -KILL "$job"; kill -CONT "$job" 2>/dev/null
        fi
    done
    wait "$job"; code=$?
    hangs=$((hangs + hung))
    echo "run $i: exit $code$([ $hung = 1 ] && echo ', hung')" | tee -a "$out/tally.txt"
done
echo "$hangs hangs in $n runs" | tee -a "$out/tally.txt"
