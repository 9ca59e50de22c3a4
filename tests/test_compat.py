"""Command lines written for the original train_multi_GPU scripts run unchanged.

The original README starts the DDP scripts with `python -m torch.distributed.launch
--nproc_per_node=N --use_env train_multi_gpu_using_launch.py` and `python
train_multi_gpu_using_spawn.py`, and the scripts' options are spelled --num_classes, --syncBN
True/False, --freeze-layers False, --weights '', --device, --dist-url and --world-size.
"""
from __future__ import annotations

import socket
import sys

import pytest
import torch
from conftest import SAMPLE, metrics, ok, run_cli, user_error

import train_multi_gpu_using_launch
import train_multi_gpu_using_spawn
import train_single_gpu
from multi_train_utils.config import get_args_parser, parse_dist_url
from multi_train_utils.distributed_utils import parse_device, resolve_device
from utils import UserError

LEGACY_LAUNCH = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2"]
# The original scripts' own options, with the values of their argparse defaults; --device cpu
# and a small image size so that the command runs here, on the bundled sample.
ORIGINAL_OPTIONS = ["--num_classes", "5", "--epochs", "1", "--batch-size", "8", "--lr", "0.001", "--lrf", "0.1",
                    "--weights", "", "--freeze-layers", "False", "--data-path", str(SAMPLE)]
OURS_HERE = ["--img-size", "32", "--workers", "0", "--no-plots", "--model", "resnet18"]


def find_free_port() -> int:
    """A port nothing listens on now, on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def original_command(kind: str, port: int) -> tuple[list[str], int]:
    """(command line, world size) for each way the original README and scripts start a run."""
    table = {
        "single": ([sys.executable, "train_single_gpu.py", "--device", "cpu"], 1),
        # The launcher's own rendezvous wins over a --dist-url: the run says so, once.
        "launch --use_env": ([*LEGACY_LAUNCH, "--use_env", "train_multi_gpu_using_launch.py", "--device", "cpu",
                              "--syncBN", "True", "--world-size", "2", "--dist-url", "tcp://10.9.8.7:23456"], 2),
        "launch": ([*LEGACY_LAUNCH, "train_multi_gpu_using_launch.py", "--device", "cpu", "--syncBN", "False",
                    "--dist-url", "env://"], 2),
        # env:// is what every other spawn test uses; here the address the user gives.
        "spawn": ([sys.executable, "train_multi_gpu_using_spawn.py", "--device", "cpu", "--world-size", "2",
                   "--syncBN", "True", "--dist-url", f"tcp://127.0.0.1:{port}"], 2),
    }
    return table[kind]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["single", "launch --use_env", "launch", "spawn"])
def test_original_command_lines_train(kind, tmp_path):
    port = find_free_port()
    cmd, world_size = original_command(kind, port)
    # The spawn launcher's --dist-url wins over MASTER_ADDR and MASTER_PORT: these point at an
    # address no process here can host (TEST-NET-1), where the job would fail at once.
    env = {"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "9"} if kind == "spawn" else None
    result = ok(run_cli(cmd + ORIGINAL_OPTIONS + OURS_HERE + ["--output-dir", str(tmp_path)], timeout=240, env=env))
    [record] = metrics(tmp_path)
    assert record["world_size"] == world_size and record["train_total"] + record["val_total"] == 120
    if kind == "spawn":  # gloo kept on loopback, where --dist-url's address is
        assert "GLOO_SOCKET_IFNAME=lo (gloo stays on loopback)" in result.stdout
    if kind == "launch --use_env":
        assert result.stdout.count("--dist-url tcp://10.9.8.7:23456 is not used: the rendezvous is the one torchrun") == 1


@pytest.mark.slow
def test_world_size_that_torchrun_contradicts_is_an_error_on_every_rank(tmp_path):
    # torchrun ends the other worker once it sees one fail; looking every 10 s instead of every
    # 0.1 s lets a worker that started late (a loaded machine: 5 s was once too little on 2 Zen 3
    # cores) print its own line first.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "--monitor-interval=10",
           "train_multi_gpu_using_launch.py", "--world-size", "4", "--data-path", str(SAMPLE),
           "--output-dir", str(tmp_path), *OURS_HERE]
    result = run_cli(cmd, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: --world-size is 4, but 2")]
    assert result.returncode != 0 and len(errors) == 2, result.stderr[-3000:]


def test_world_size_without_torchrun_must_be_one(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    line = user_error(train_multi_gpu_using_launch.main, ["--world-size", "2", "--data-path", str(SAMPLE)], capsys)
    assert "--world-size is 2, but 1 process(es) were started" in line


def test_device_spellings():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device("0") == torch.device("cuda", 0) and parse_device("3") == torch.device("cuda", 3)
    assert parse_device("cuda") == torch.device("cuda") and parse_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UserError, match="names several devices.*CUDA_VISIBLE_DEVICES=0,1"):
        parse_device("0,1")
    with pytest.raises(UserError, match="is not a device"):
        parse_device("gpu")


def test_a_gpu_index_must_agree_with_the_local_rank(monkeypatch):
    """In a job each process takes the GPU of its local rank; `--device` picks the type only."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("cuda", 2, 4, distributed=True) == torch.device("cuda", 2)
    assert resolve_device("1", 0) == torch.device("cuda", 1)  # one process: any GPU it names
    assert resolve_device("cuda:0", 0, 1, distributed=True) == torch.device("cuda", 0)
    for spec, local_rank, local_world_size in (("cuda:1", 0, 1), ("0", 0, 2), ("cuda:1", 1, 2)):
        with pytest.raises(UserError, match=f"--device {spec} names GPU .* pass --device cuda"):
            resolve_device(spec, local_rank, local_world_size, distributed=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("main, argv", [
    (train_single_gpu.main, ["--device", "cuda"]),
    (train_single_gpu.main, ["--device", "0"]),
    (train_multi_gpu_using_spawn.main, ["--device", "cuda", "--world-size", "2"]),
])
def test_cuda_without_a_gpu_is_a_clear_error(main, argv, capsys):
    line = user_error(main, [*argv, "--data-path", str(SAMPLE)], capsys)
    assert "no GPU is visible" in line


def test_dist_url():
    assert parse_dist_url("env://") is None
    assert parse_dist_url("tcp://127.0.0.1:23456") == ("127.0.0.1", 23456)
    assert parse_dist_url("tcp://node-1.cluster:29500") == ("node-1.cluster", 29500)
    for bad in ("tcp://127.0.0.1", "file:///tmp/rendezvous", "127.0.0.1:23456", "tcp://host:port"):
        with pytest.raises(UserError, match="is not env:// or tcp://HOST:PORT"):
            parse_dist_url(bad)


def test_help_keeps_the_original_spellings_apart():
    for launcher, extra in (("single", set()), ("launch", {"--dist-url", "--world-size"}),
                            ("spawn", {"--dist-url"})):
        parser = get_args_parser("test", launcher)
        groups = {g.title: {s for a in g._group_actions for s in a.option_strings} for g in parser._action_groups}
        assert groups["the original scripts' spellings"] == {"--num_classes", "--syncBN"} | extra | (
            {"--local-rank", "--local_rank"} if launcher == "launch" else set())
        main_options = set().union(*(v for k, v in groups.items() if k != "the original scripts' spellings"))
        assert {"--num-classes", "--sync-bn", "--device"} <= main_options
        assert not main_options & {"--num_classes", "--syncBN", "--dist-url"}
        args = parser.parse_args(["--syncBN", "False", "--num_classes", "5", "--weights", "", "--freeze-layers",
                                  "False"])
        assert (args.sync_bn, args.num_classes, args.weights, args.freeze_layers) == (False, 5, "", False)
