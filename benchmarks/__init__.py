"""Measure this project against the recipe it started from: training speed, the data path, accuracy.

    # training images/s: seed vs ours (and torch.compile, --cache), 1 and 2 processes,
    # real JPEGs and synthetic input, interleaved over 3 repetitions; JSON + PNG
    python -m benchmarks throughput --data-path DATA --world-sizes 1 2 \\
        --configs seed ours ours-compile@1 ours-cache --out docs/benchmark/cpu-throughput.json

    # images/s of each decode + transform path, one process
    python -m benchmarks data --data-path DATA --out docs/benchmark/cpu-data.json

    # validation accuracy of the seed recipe and of ours (run through train_single_gpu.py)
    python -m benchmarks accuracy --data-path DATA --img-size 128 --epochs 20 --out docs/benchmark/accuracy.json

    # what a time budget buys: ours with --time-budget at shares of the seed recipe's 30-epoch time
    python -m benchmarks accuracy --data-path DATA --img-size 128 --epochs 30 --seeds 0 1 2 \\
        --budgets 0.2 1 --out docs/benchmark/accuracy-budgets.json

    # wall clock of whole train_single_gpu.py commands on a folder of 3,670 images (DATA's, repeated)
    python -m benchmarks endtoend --data-path DATA --images 3670 --epochs 10 --variant '' --variant=--device-augment

    # where one training step of 256 spends the device's time, by kind of kernel, against its FLOPs
    python -m benchmarks profile --data-path DATA --batch-size 256 --out docs/benchmark/gpu-profile.json

These are the commands behind the results in docs/benchmark/, where DATA is a folder of real
photos, one sub-folder per class (the README's Performance section names the one used). Run
them from the repository root: the package imports the project's modules from there.

"seed" is the recipe of WZMIAOMIAO's train_multi_GPU that this project grew from: fp32, NCHW,
PIL + torchvision.transforms v1, SGD(lr=0.001 x processes, momentum 0.9, weight decay 5e-3 on
every parameter), a cosine schedule stepped per epoch, and a host sync (`loss.item()`) plus a
loss all-reduce at every step. "ours" is this project's defaults, assembled from its own functions.
Both use the project's split and ResNet34, so only the recipe differs.

How the throughput is measured, and why:
- every measurement runs in fresh processes started with torch.multiprocessing (as the spawn
  launcher does), so peak memory belongs to that configuration alone; world size N is N DDP
  processes (gloo on the CPU, each with its share of the cores), rank 0 collecting;
- configurations are interleaved (A B C, then C B A, ...) and each figure is the median over
  repetitions, so slow drift in the machine's other load touches every configuration alike;
- a step is timed from taking one batch to taking the next (CUDA events on a GPU): the loop's
  own work plus any wait for data; warm-up steps, which include torch.compile, are excluded.

Modules: `seed_recipe` (the seed, frozen) and `ours_recipe` (our configurations) are what is
measured; `instruments` is what measures and records; `throughput`, `data`, `accuracy`, `endtoend` and
`profile` are the experiments, and `__main__` their command line.
"""
