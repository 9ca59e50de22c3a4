"""What a reader of a launcher meets, counted from the code (ast): the project's own names it
imports and uses, the methods it calls on objects that project code returns, its length, and
torch's own calls for the steps of data-parallel training, written in the launcher itself."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

from test_layout import project_modules

# The most a launcher asks a reader to learn beyond torch: project names, methods of project
# objects, lines. Each multi-process launcher writes torch's init_process_group itself, and so
# names what it needs for it: the device, cores and backend (process_context) and the store
# (job_store). The spawn launcher adds what starting processes takes (the ranks it gives each
# worker, where they meet, SIGTERM blocked in a child until its handler is set, the processes
# joined): four names more. Each counts Preemption, its one SIGTERM handler, set on its first
# lines. Each name does one thing, and says which (no function with two modes, no constructor
# with side effects): the command line parsed, then checked and its images listed; the run
# folder created, then --resume's checkpoint read; --eval-only's evaluation, or the end of a
# run's report. The single launcher has no collectives for --trace-collectives's recorder
# (collective_trace) to record.
LIMITS = {"train_multi_gpu_using_launch.py": (21, 8, 250), "train_single_gpu.py": (18, 8, 250),
          "train_multi_gpu_using_spawn.py": (25, 8, 250)}


def project_names(path: Path) -> list[str]:
    """The names a launcher imports from the project's modules and uses."""
    tree = ast.parse(path.read_text())
    modules = {m.split(".")[0] for m in project_modules()}
    imported = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[0] in modules for alias in node.names}
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return sorted(imported & used)


def project_methods(path: Path) -> list[str]:
    """The methods a launcher calls on objects that project code returned: on what a call of a
    project name gave (assigned, unpacked, or bound by a `with`), and on its own functions'
    parameters (the plan, the process's context)."""
    tree = ast.parse(path.read_text())
    names = set(project_names(path))
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    objects = {a.arg for f in functions for a in f.args.args}

    def from_project(value: ast.AST | None) -> bool:
        """A call of a project name (or of a method of a project object), possibly in an `x if c else y`."""
        return any(isinstance(call, ast.Call) and any(isinstance(n, ast.Name) and n.id in names | objects
                                                      for n in ast.walk(call.func)) for call in ast.walk(value))

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign) and from_project(node.value):
            targets = node.targets
        elif isinstance(node, ast.withitem) and node.optional_vars is not None and from_project(node.context_expr):
            targets = [node.optional_vars]
        for target in targets:
            objects |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return sorted({node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                   and node.func.value.id in objects})


@pytest.mark.parametrize("launcher", sorted(LIMITS))
def test_a_launcher_asks_little_beyond_torch(launcher):
    names, methods, lines = LIMITS[launcher]
    path = REPO / launcher
    assert len(project_names(path)) <= names, project_names(path)
    assert len(project_methods(path)) <= methods, project_methods(path)
    assert len(path.read_text().splitlines()) <= lines


@pytest.mark.parametrize("launcher", ["train_multi_gpu_using_launch.py", "train_multi_gpu_using_spawn.py"])
def test_torchs_calls_are_written_in_the_launcher(launcher):
    """The steps of data-parallel training in torch's own words, on the launcher's page: the
    process group joined, the sampler, its set_epoch, SyncBatchNorm's conversion, the wrap, the
    teardown."""
    source = (REPO / launcher).read_text()
    for call in ("DistributedSampler(", "train_sampler.set_epoch(epoch)", "nn.SyncBatchNorm.convert_sync_batchnorm(model)",
                 "DDP(model", "dist.destroy_process_group()", "dist.init_process_group("):
        assert call in source, call


def test_backward_and_the_optimizer_step_are_written_in_train_one_epoch():
    source = (REPO / "multi_train_utils" / "train_eval_utils.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "train_one_epoch")
    body = ast.get_source_segment(source, node)
    assert ".backward()" in body and "scaler.step(optimizer)" in body and "all_reduce_sum(" in body


def test_the_counts_see_what_they_count(tmp_path):
    """A launcher that imports one project name more, and calls a method more on a project object."""
    source = (REPO / "train_multi_gpu_using_launch.py").read_text()
    grown = tmp_path / "grown.py"
    grown.write_text(source.replace("from utils import exit_on_error", "from utils import exit_on_error, read_json")
                     .replace("    began = time.perf_counter()\n", "    began = time.perf_counter()\n    read_json(plan.extra())\n"))
    assert set(project_names(grown)) - set(project_names(REPO / "train_multi_gpu_using_launch.py")) == {"read_json"}
    assert set(project_methods(grown)) - set(project_methods(REPO / "train_multi_gpu_using_launch.py")) == {"extra"}


# The eight steps of data-parallel training, and where a reader of the torchrun launcher finds
# each: the file, the function (None: the launcher's page itself) and torch's call there.
LAUNCHER = "train_multi_gpu_using_launch.py"
EIGHT_STEPS = [
    ("join the process group", LAUNCHER, None, "dist.init_process_group("),
    ("the sampler", LAUNCHER, None, "DistributedSampler("),
    ("its set_epoch", LAUNCHER, None, "train_sampler.set_epoch(epoch)"),
    ("SyncBatchNorm", LAUNCHER, None, "nn.SyncBatchNorm.convert_sync_batchnorm(model)"),
    ("the DDP wrap", LAUNCHER, None, "DDP(model"),
    ("backward", "multi_train_utils/train_eval_utils.py", "train_one_epoch", ".backward()"),
    ("the optimizer's step", "multi_train_utils/train_eval_utils.py", "train_one_epoch", "scaler.step(optimizer)"),
    ("the metrics' all_reduce", "multi_train_utils/train_eval_utils.py", "train_one_epoch", "all_reduce_sum("),
    ("the metrics' all_reduce", "multi_train_utils/distributed_utils.py", "all_reduce_sum", "dist.all_reduce("),
    ("rank 0's save", LAUNCHER, None, "if ctx.is_main:"),
    ("rank 0's save", "multi_train_utils/checkpoint.py", "save_atomic", "torch.save("),
    ("destroy", LAUNCHER, None, "dist.destroy_process_group()"),
]


def function_source(path: str, name: str) -> str:
    source = (REPO / path).read_text()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(source, node)


def eight_steps_path() -> tuple[list[str], int]:
    """The core files a reader of the torchrun launcher opens for the eight steps, and the lines
    read: the launcher whole, and each function the steps send them to."""
    functions = {(path, name) for _, path, name, _ in EIGHT_STEPS if name}
    read = len((REPO / LAUNCHER).read_text().splitlines())
    read += sum(len(function_source(path, name).splitlines()) for path, name in functions)
    return sorted({path for path, _ in functions}), read


def test_the_eight_steps_are_in_the_launcher_and_three_files_of_the_core():
    """Init, the sampler and set_epoch, SyncBatchNorm, the wrap, backward and the optimizer's
    step, the metrics' all_reduce, rank 0's save and the teardown: each where the table says,
    in at most 3 files of multi_train_utils/ and 400 lines read (the page states the figure)."""
    for step, path, name, call in EIGHT_STEPS:
        source = function_source(path, name) if name else (REPO / path).read_text()
        assert call in source, f"{step}: {call} is not in {name or path}"
    files, read = eight_steps_path()
    assert len(files) <= 3 and all(f.startswith("multi_train_utils/") for f in files), files
    assert read <= 400, read
    # The save goes through rank 0's RunFiles (outputs/); the launcher's comment sends a reader to torch.save.
    assert "save_atomic() in multi_train_utils/checkpoint.py" in " ".join(
        line.strip().lstrip("# ") for line in (REPO / LAUNCHER).read_text().splitlines())
    page = " ".join((REPO / "docs" / "how-it-works.md").read_text().split())
    stated = re.search(r"eight steps.*?: (\d+) lines, in the launcher and (\d) files of the core", page)
    assert stated, "the tour states the eight steps' path: N lines, in the launcher and K files of the core"
    assert (int(stated[1]), int(stated[2])) == (read, len(files))
    # On a GPU the step is a replayed graph: the function and the page say so where the step is.
    assert "replayed" in function_source("multi_train_utils/train_eval_utils.py", "train_one_epoch")


# The `with` and `try` blocks a launcher's epoch loop runs in, from the function that starts the
# process (main(), the spawn launcher's worker()) through train(): the process group's teardown,
# rank 0's files. The spawn launcher's worker adds one: its errors name its rank (exit_on_error(rank)).
DEPTH = {"train_multi_gpu_using_launch.py": 2, "train_single_gpu.py": 1, "train_multi_gpu_using_spawn.py": 3}


def loop_depth(source: str) -> int:
    """The `with` and `try` statements around train()'s `for epoch` loop, and around the call of
    train() in the function that makes it."""
    functions = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    loop = next(n for n in ast.walk(functions["train"]) if isinstance(n, ast.For) and ast.unparse(n.target) == "epoch")
    caller, call = next((f, n) for f in functions.values() for n in ast.walk(f)
                        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "train")

    def around(function: ast.FunctionDef, target: ast.AST) -> int:
        return sum(isinstance(n, (ast.With, ast.Try)) and any(c is target for c in ast.walk(n)) for n in ast.walk(function))
    return around(functions["train"], loop) + around(caller, call)


@pytest.mark.parametrize("launcher", sorted(DEPTH))
def test_the_epoch_loop_runs_in_few_with_and_try_blocks(launcher):
    assert loop_depth((REPO / launcher).read_text()) <= DEPTH[launcher]


def test_the_depth_sees_a_block_more():
    source = (REPO / LAUNCHER).read_text()
    wrapped = source.replace("        train(plan, ctx, output_dir)\n",
                             "        with nullcontext():\n            train(plan, ctx, output_dir)\n")
    assert wrapped != source and loop_depth(wrapped) == loop_depth(source) + 1
