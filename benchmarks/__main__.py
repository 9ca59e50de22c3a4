"""`python -m benchmarks {throughput,data,accuracy,endtoend,profile,startup,decode}`: the command line of the experiments."""
from __future__ import annotations

import argparse

import benchmarks
from benchmarks.accuracy import accuracy
from benchmarks.data import data_paths
from benchmarks.decode import decode_rates
from benchmarks.endtoend import LAUNCHERS, endtoend, tree_spec
from benchmarks.ours_recipe import CONFIGS
from benchmarks.profile import profile_steps
from benchmarks.startup import startup
from benchmarks.throughput import throughput
from multi_train_utils.config import BoolFlag
from utils import exit_on_error


def config_spec(text: str) -> tuple[str, int | None]:
    """A --configs value: NAME, or NAME@N for that configuration at world size N only."""
    name, _, size = text.partition("@")
    if name not in CONFIGS or (size and not size.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME or NAME@N with NAME one of {', '.join(CONFIGS)}")
    return name, int(size) if size else None


def build_parser() -> argparse.ArgumentParser:
    # prog: under -m, argparse would name the program __main__.py.
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=benchmarks.__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, out: str, img_size: int) -> None:
        p.add_argument("--data-path", required=True, help="one sub-folder of real photos per class")
        p.add_argument("--img-size", type=int, default=img_size)
        p.add_argument("--out", default=out, help="JSON result; a PNG of the same name goes next to it")
        p.add_argument("--machine", default=None, help="the machine's name in the results (default: from the CPU)")

    t = sub.add_parser("throughput", help="training images/s, loader images/s, epoch time and memory per config")
    common(t, "docs/benchmark/cpu-throughput.json", 224)
    t.add_argument("--configs", nargs="+", type=config_spec, default=[("seed", None), ("ours", None)],
                   metavar="NAME[@N]", help=f"{', '.join(CONFIGS)}; NAME@N: that one at world size N only "
                                            "(default: seed ours)")
    t.add_argument("--images", type=int, default=0,
                   help="measure on a folder of this many pictures, hard links to --data-path's (0: --data-path "
                        "itself): large batches need more training images than warm-up + steps batches")
    t.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    t.add_argument("--launcher", choices=["spawn", "single"], default="spawn",
                   help="spawn: fresh processes per measurement (needed for world size > 1 and for memory); "
                        "single: world size 1 inside this process, e.g. under a profiler")
    t.add_argument("--batch-size", type=int, default=16, help="per process")
    t.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    t.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--synthetic", action=BoolFlag, default=True, help="random tensors on the device, no loader")
    t.add_argument("--real", action=BoolFlag, default=True, help="the photos through each config's loader")

    d = sub.add_parser("data", help="images/s of each JPEG decode + transform path in one process")
    common(d, "docs/benchmark/cpu-data.json", 224)
    d.add_argument("--images", type=int, default=0, help="images timed per path, spread over the classes (0: all)")
    d.add_argument("--repeats", type=int, default=5)

    a = sub.add_parser("accuracy", help="validation accuracy of the seed recipe and of ours, trained from scratch")
    common(a, "docs/benchmark/accuracy.json", 128)
    a.add_argument("--epochs", type=int, default=20)
    a.add_argument("--batch-size", type=int, default=16)
    a.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                   help="each sets the split, the initial weights and the augmentation, for every recipe")
    a.add_argument("--variant", action="append", default=[], metavar="OPTIONS",
                   help="also train ours with these extra options, e.g. --variant '--lr 0.2' (repeatable; one "
                        "option alone needs the = form: --variant=--cache)")
    a.add_argument("--skip-seed", action="store_true", help="train only ours and its variants")
    a.add_argument("--seed-runs", default=None, metavar="RESULT.json",
                   help="take the seed recipe's runs from an earlier result of this command on the same data and "
                        "settings instead of training them again (to screen options of ours); seeds it lacks are "
                        "trained")
    a.add_argument("--budgets", type=float, nargs="+", default=[], metavar="SHARE",
                   help="train ours with --time-budget at these shares of the time the seed recipe's run of the same "
                        "seed took, e.g. --budgets 0.2 0.33 0.5 1 (default: ours with --epochs, no budget)")
    a.add_argument("--variant-budgets", type=float, nargs="+", default=[], metavar="SHARE",
                   help="the shares each --variant trains at (default: --budgets)")
    a.add_argument("--runs-dir", default=None, help="where ours' run folders go (default: runs/benchmark-accuracy-TIME)")

    e = sub.add_parser("endtoend", help="wall clock of whole training commands on a folder of a given size, and "
                                        "their time to the seed recipe's final accuracy, trained beside them")
    common(e, "docs/benchmark/endtoend.json", 224)
    e.add_argument("--images", type=int, default=3670,
                   help="pictures in the folder trained on, made of hard links to --data-path's (flower_photos has 3670)")
    e.add_argument("--epochs", type=int, default=10)
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--variant", action="append", default=[], metavar="OPTIONS",
                   help="time the launcher with these options (repeatable; they override the ones above), "
                        "e.g. --variant '' --variant '--compile --batch-size 256'; one option alone needs the = "
                        "form: --variant=--compile (default: one run of the defaults)")
    e.add_argument("--launcher", choices=list(LAUNCHERS), default="single")
    e.add_argument("--nproc", type=int, default=None, help="processes for spawn and torchrun (default 2)")
    e.add_argument("--tree", action="append", default=[], type=tree_spec, metavar="NAME=PATH",
                   help="run the same commands in this checkout too (repeatable; e.g. a `git worktree` of an "
                        "older commit, for a before-and-after in one sitting; default: this checkout alone)")
    e.add_argument("--seed-recipe", action=BoolFlag, default=True,
                   help="also train the seed recipe (benchmarks/seed_recipe.py, one process, as a command of its "
                        "own) on the same folder and settings, once per repeat; its final validation accuracy is "
                        "the target whose time each run reports (--no-seed-recipe: the times to the end only)")

    p = sub.add_parser("profile", help="where one training step of ours spends the device's time, by kind of kernel")
    common(p, "docs/benchmark/profile.json", 224)
    p.add_argument("--device", default=None, help="as the launchers take it (default: CUDA when present)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="steps timed, then as many profiled")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--options", default="", type=str.split, metavar="OPTIONS",
                   help="the launchers' options on top of the defaults, e.g. --options '--compile'")

    g = sub.add_parser("decode", help="images/s of --device-augment's start-up decoding: nvJPEG against the CPU")
    common(g, "docs/benchmark/decode.json", 224)
    g.add_argument("--device", default=None, help="the GPU (default: cuda; the CPU decodes both ways without one)")
    g.add_argument("--threads", type=int, default=0, help="the CPU's decoding threads (default: the usable cores)")
    g.add_argument("--repeats", type=int, default=3)

    s = sub.add_parser("startup", help="seconds to the first step and peak memory, new run and resume, by folder size")
    common(s, "docs/benchmark/cpu-startup.json", 32)
    s.add_argument("--images", type=int, nargs="+", default=[3670, 20000, 100000],
                   help="folder sizes, hard links to --data-path's pictures")
    s.add_argument("--options", default="", type=str.split, metavar="OPTIONS",
                   help="the launcher's options on top of the defaults, e.g. --options '--cache'")
    return parser


@exit_on_error  # an error: one `error:` line (or a traceback) and an exit code; Ctrl-C: 130
def main() -> None:
    args = build_parser().parse_args()
    {"throughput": throughput, "data": data_paths, "accuracy": accuracy, "endtoend": endtoend,
     "profile": profile_steps, "startup": startup, "decode": decode_rates}[args.command](args)


if __name__ == "__main__":
    main()
