"""Train ResNet34 on an image folder in one process, on one GPU or the CPU.

    python train_single_gpu.py --data-path data/flower_photos_sample --epochs 3
    python train_single_gpu.py --device cuda:1 --data-path dataset/flower_photos --download
    python train_single_gpu.py --data-path dataset/flower_photos --check    # diagnose, do not train

See README.md for every option; all three launchers share them.
"""
import sys

from multi_train_utils.check import check
from multi_train_utils.config import get_args_parser, prepare
from multi_train_utils.distributed_utils import setup_single
from multi_train_utils.run import run
from utils import exit_on_error


def main() -> None:
    args = get_args_parser(__doc__.splitlines()[0], launcher="single").parse_args()
    with exit_on_error():
        plan = prepare(args, launcher="single")
        if args.check:
            sys.exit(check(plan, None))
        run(plan, setup_single(args.device))


if __name__ == "__main__":
    main()
