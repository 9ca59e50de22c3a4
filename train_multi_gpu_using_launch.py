"""Train ResNet34 with DistributedDataParallel, one process per GPU, started by torchrun.

    torchrun --nproc_per_node=4 train_multi_gpu_using_launch.py --data-path dataset/flower_photos
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        train_multi_gpu_using_launch.py ...
    srun python train_multi_gpu_using_launch.py ...      # SLURM, one task per GPU
    torchrun --nproc_per_node=4 train_multi_gpu_using_launch.py ... --check   # diagnose, do not train

Rank, local rank and world size come from the environment that torchrun, the legacy
`python -m torch.distributed.launch` or SLURM sets. Run without any of them, it trains in
one process. See README.md for every option; all three launchers share them.
"""
import os
import sys

from multi_train_utils.check import check
from multi_train_utils.config import get_args_parser, prepare
from multi_train_utils.distributed_utils import Rendezvous, env_ranks, parse_dist_url, setup_single, teardown
from multi_train_utils.run import run
from utils import UserError, exit_on_error


def main() -> None:
    args = get_args_parser(__doc__.splitlines()[0], launcher="launch").parse_args()
    with exit_on_error():
        ranks = env_ranks(args.local_rank)
        rank, local_rank, world_size, local_world_size = ranks or (0, 0, 1, 1)
        if args.world_size is not None and args.world_size != world_size:
            raise UserError(f"--world-size is {args.world_size}, but {world_size} process(es) were started: "
                            "start as many as you ask for (torchrun --nproc_per_node, srun --ntasks), or drop it")
        plan = prepare(args, launcher="launch", verbose=local_rank == 0)
        if rank == 0 and parse_dist_url(args.dist_url):
            where = (f"the one torchrun or srun set, {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                     if ranks else "not needed for one process")
            print(f"--dist-url {args.dist_url} is not used: the rendezvous is {where}")
        if ranks is None:
            if args.check:
                sys.exit(check(plan, None))
            print("not started by torchrun or srun: training in one process")
            run(plan, setup_single(args.device))
            return
        rdzv = Rendezvous(rank, local_rank, world_size, local_world_size)
        if args.check:
            sys.exit(check(plan, rdzv))
        try:
            run(plan, rdzv.join(args.device, args.backend, args.dist_timeout))
        finally:
            teardown()


if __name__ == "__main__":
    main()
