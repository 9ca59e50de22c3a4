"""Train ResNet34 with DistributedDataParallel, one process per GPU, started by torchrun.

    torchrun --nproc_per_node=4 train_multi_gpu_using_launch.py --data-path dataset/flower_photos
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        train_multi_gpu_using_launch.py ...
    srun python train_multi_gpu_using_launch.py ...      # SLURM, one task per GPU

Rank, local rank and world size come from the environment that torchrun, the legacy
`python -m torch.distributed.launch` or SLURM sets. Run without any of them, it trains in
one process. See README.md for every option; all three launchers share them.
"""
import argparse

from multi_train_utils.config import get_args_parser, prepare
from multi_train_utils.distributed_utils import (
    env_ranks,
    setup_process_group,
    setup_single,
    teardown,
)
from multi_train_utils.train_eval_utils import run
from utils import exit_on_error


def main() -> None:
    parser = get_args_parser(__doc__.splitlines()[0])
    # torch.distributed.launch without --use_env passes the local rank as an argument.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with exit_on_error():
        ranks = env_ranks(args.local_rank)
        plan = prepare(args, launcher="launch", verbose=ranks is None or ranks[1] == 0)
        if ranks is None:
            print("not started by torchrun or srun: training in one process")
            run(plan, setup_single(None))
            return
        rank, local_rank, world_size, local_world_size = ranks
        try:
            ctx = setup_process_group(rank, local_rank, world_size, local_world_size,
                                      None, args.backend, args.dist_timeout)
            run(plan, ctx)
        finally:
            teardown()


if __name__ == "__main__":
    main()
