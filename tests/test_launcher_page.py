"""What a reader of a launcher meets, read from the code (ast), no process started: the spawn
launcher's train() is the torchrun launcher's, line for line; the nine steps of data-parallel
training are torch's calls on the launcher's page, or one call below it in at most two files of
the core, as the tour says; each launcher reads top to bottom, every feature a default run does
not use entered by one `if`. (Names are not counted: what a default run executes is,
tests/test_default_run.py. That every launcher line leading to a collective says which in its
comment is tests/test_meeting_points.py's.)"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

LAUNCHER = "train_multi_gpu_using_launch.py"
SPAWN = "train_multi_gpu_using_spawn.py"
TRAIN_EVAL = "multi_train_utils/train_eval_utils.py"
CHECKPOINT = "multi_train_utils/checkpoint.py"
# all_reduce_sum() is named for its collective: a reader who meets it in train_one_epoch knows what
# it makes without opening the file (the tour says where it is, and does not count the file).
COLLECTIVE_HELPERS = "multi_train_utils/distributed_utils.py"
TOUR = REPO / "docs" / "how-it-works.md"


def functions(path: Path) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def names_used(path: Path, node: ast.AST) -> list[tuple[ast.AST, str]]:
    """Each name `node` calls or hands on (`convert_sync_batchnorm` chosen in an `x if c else y`),
    as (the node, the name), a dotted one also whole (`scaler.step`); names imported under another
    name (`DDP`) are given their own."""
    tree = ast.parse(path.read_text())
    alias = {a.asname: a.name.rpartition(".")[2] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names if a.asname}
    found = []
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
            found += [(n, alias.get(n.attr, n.attr)), (n, ast.unparse(n))]
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            found.append((n, alias.get(n.id, n.id)))
    return found


def within(outer: ast.AST, inner: ast.AST) -> bool:
    return any(n is inner for n in ast.walk(outer))


# The nine steps of data-parallel training, as a reader of a multi-process launcher follows them:
# each a chain of (file, function, the name it calls), from the launcher's own function down to
# torch's call. "start": the function that starts the process (main(), the spawn launcher's worker()).
NINE_STEPS = {
    "join the process group": [("launcher", "start", "dist.init_process_group")],
    "the sampler": [("launcher", "train", "DistributedSampler")],
    "its set_epoch": [("launcher", "train", "train_sampler.set_epoch")],
    "SyncBatchNorm": [("launcher", "train", "nn.SyncBatchNorm.convert_sync_batchnorm")],
    "the DDP wrap": [("launcher", "train", "DistributedDataParallel")],
    "backward and the optimizer's step": [("launcher", "train", "train_one_epoch"),
                                          (TRAIN_EVAL, "train_one_epoch", "backward"),
                                          (TRAIN_EVAL, "train_one_epoch", "scaler.step")],
    "the metrics' all_reduce": [("launcher", "train", "train_one_epoch"),
                                (TRAIN_EVAL, "train_one_epoch", "all_reduce_sum"),
                                (COLLECTIVE_HELPERS, "all_reduce_sum", "dist.all_reduce")],
    "rank 0's save": [("launcher", "train", "save_checkpoint"), (CHECKPOINT, "save_checkpoint", "save_atomic"),
                      (CHECKPOINT, "save_atomic", "torch.save")],
    "the teardown": [("launcher", "start", "dist.destroy_process_group")],
}
START = {LAUNCHER: "main", SPAWN: "worker"}


def step_problems(launcher: str, steps: dict = NINE_STEPS, root: Path = REPO) -> list[str]:
    """Each link of each step's chain that the code does not make."""
    problems = []
    for step, chain in steps.items():
        for file, function, name in chain:
            path = root / (launcher if file == "launcher" else file)
            function = START[launcher] if function == "start" else function
            node = functions(path).get(function)
            if node is None or not any(used == name for _, used in names_used(path, node)):
                problems.append(f"{step}: {function}() in {path.relative_to(root)} does not call {name}")
    return problems


def step_files(steps: dict = NINE_STEPS) -> set[str]:
    """The files besides the launcher a reader opens for the nine steps."""
    return {file for chain in steps.values() for file, _, _ in chain} - {"launcher", COLLECTIVE_HELPERS}


@pytest.mark.parametrize("launcher", [LAUNCHER, SPAWN])
def test_the_nine_steps_lie_in_the_launcher_and_two_files_of_the_core(launcher):
    assert len(NINE_STEPS) == 9 and step_problems(launcher) == []
    assert len(step_files()) <= 2, step_files()


def test_the_tour_says_where_the_nine_steps_lie():
    """The tour's count of the files, and the function and file where each step's torch call is
    made below the launcher."""
    page = " ".join(TOUR.read_text().split())
    stated = re.search(r"The nine steps\*\* of data-parallel training lie in the launcher and (\w+) files? of the core",
                       page)
    assert stated, "the tour says: The nine steps of data-parallel training lie in the launcher and K files of the core"
    assert stated[1] == {1: "one", 2: "two", 3: "three"}[len(step_files())]
    paragraph = page[stated.start():page.index("## 1. ", stated.start())]
    for file, function, _ in (chain[-1] for chain in NINE_STEPS.values() if chain[-1][0] != "launcher"):
        assert f"`{function}()` in `{file}`" in paragraph, (function, file)
    # On one GPU the step is a replayed CUDA graph: the function says so where the step is, and the tour.
    train_one_epoch = functions(REPO / TRAIN_EVAL)["train_one_epoch"]
    assert "replayed" in ast.get_source_segment((REPO / TRAIN_EVAL).read_text(), train_one_epoch)
    assert "the step is replayed" in page


def test_a_step_moved_away_is_caught(tmp_path):
    """A copy of the core in which save_checkpoint writes with a helper of another name, and of a
    launcher whose train() no longer calls set_epoch."""
    for file in (LAUNCHER, TRAIN_EVAL, CHECKPOINT, COLLECTIVE_HELPERS):
        copy = tmp_path / file
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text((REPO / file).read_text())
    checkpoint = (tmp_path / CHECKPOINT).read_text()
    assert checkpoint.count("save_atomic(checkpoint, ") == 3
    (tmp_path / CHECKPOINT).write_text(checkpoint.replace("save_atomic(checkpoint, ", "write_atomically(checkpoint, "))
    launcher = (tmp_path / LAUNCHER).read_text()
    assert "train_sampler.set_epoch(epoch)" in launcher
    (tmp_path / LAUNCHER).write_text(launcher.replace("train_sampler.set_epoch(epoch)", "pass"))
    problems = step_problems(LAUNCHER, root=tmp_path)
    assert f"rank 0's save: save_checkpoint() in {CHECKPOINT} does not call save_atomic" in problems, problems
    assert f"its set_epoch: train() in {LAUNCHER} does not call train_sampler.set_epoch" in problems, problems
    assert len(problems) == 2, problems
    assert step_files({**NINE_STEPS, "x": [("model.py", "create_model", "resnet34")]}) == {TRAIN_EVAL, CHECKPOINT,
                                                                                       "model.py"}


@pytest.mark.parametrize("launcher", [LAUNCHER, SPAWN])
def test_rank_0_alone_saves_and_every_rank_tears_down(launcher):
    """The save's call sits in `if ctx.is_main:` inside the epoch loop, after set_epoch, its
    comment sending a reader to torch.save; the teardown in a `finally` of the function that
    joined the group."""
    path = REPO / launcher
    defs = functions(path)
    loop = next(n for n in ast.walk(defs["train"]) if isinstance(n, ast.For) and ast.unparse(n.target) == "epoch")
    calls = {name: node for node, name in names_used(path, loop)}
    blocks = [n for n in ast.walk(loop) if isinstance(n, ast.If) and ast.unparse(n.test) == "ctx.is_main"]
    assert any(within(block, calls["save_checkpoint"]) for block in blocks)
    assert calls["set_epoch"].lineno < calls["train_one_epoch"].lineno < calls["save_checkpoint"].lineno
    assert "torch.save" in path.read_text().splitlines()[calls["save_checkpoint"].lineno - 2]
    start = defs[START[launcher]]
    teardown = next(node for node, name in names_used(path, start) if name == "destroy_process_group")
    assert any(within(ast.Module(body=t.finalbody, type_ignores=[]), teardown)
               for t in ast.walk(start) if isinstance(t, ast.Try))


def test_the_spawn_launchers_train_is_the_torchrun_launchers():
    """Line for line, as the spawn launcher's docstring and the tour say: each launcher reads alone,
    and the copies cannot part."""
    def train(launcher: str) -> list[str]:
        source = (REPO / launcher).read_text()
        return ast.get_source_segment(source, functions(REPO / launcher)["train"]).splitlines()

    assert train(SPAWN) == train(LAUNCHER)
    page = " ".join(TOUR.read_text().split())
    assert "the same `train()`, line for line" in page and "`tests/test_launcher_page.py` checks" in page


# Where the spawn launcher starts its processes: the way it runs, not a feature.
SPAWN_START = {"meeting_point", "join_processes"}
# What a guard may not be: a default run is distributed, and has a rank 0.
NO_GUARD = {"ctx.is_main", "ctx.distributed"}


def unguarded_calls(path: Path) -> list[str]:
    """The calls of modules the launcher imports below its comment "What a default run never
    enters" (and of what it imports inside a function: check()) that no `if`, conditional
    expression, `and` or `or` guards: each feature a default run does not use is entered by one."""
    source = path.read_text()
    tree = ast.parse(source)
    below = source[:source.index("# What a default run never enters")].count("\n") + 1
    features = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                and (n.lineno > below or n.col_offset > 0) for a in n.names}
    guards = [(n, n.test) for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp))]
    guards += [(ast.Module(body=[ast.Expr(v) for v in n.values[1:]], type_ignores=[]), n.values[0])
               for n in ast.walk(tree) if isinstance(n, ast.BoolOp)]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.value if isinstance(node.func, ast.Attribute) else node.func
        name = ast.unparse(node.func)
        if not (isinstance(func, ast.Name) and func.id in features) or name.rpartition(".")[2] in SPAWN_START:
            continue
        if not any(within(block, node) and not within(test, node) and ast.unparse(test) not in NO_GUARD
                   for block, test in guards):
            found.append(f"{path.name}:{node.lineno}: {name}()")
    return found


@pytest.mark.parametrize("launcher", [LAUNCHER, SPAWN, "train_single_gpu.py"])
def test_each_feature_is_entered_by_one_if(launcher):
    """And the launcher reads top to bottom, in at most 250 lines: no function of its own but
    main(), worker(), train()."""
    path = REPO / launcher
    assert unguarded_calls(path) == []
    assert set(functions(path)) <= {"main", "worker", "train"}
    assert len(path.read_text().splitlines()) <= 250


def test_an_unguarded_feature_is_caught(tmp_path):
    source = (REPO / LAUNCHER).read_text()
    old = "    if args.report:  # barrier, all_gather, all_reduce, all_gather: best.pth's weights, class by class\n" \
          "        report.report_on_best("
    assert old in source
    unguarded = tmp_path / LAUNCHER
    unguarded.write_text(source.replace(old, "    report.report_on_best("))
    assert [line.split(": ")[1] for line in unguarded_calls(unguarded)] == ["report.report_on_best()"]
    guarded_by_rank = source.replace("        if args.plots:  # the curves", "        if ctx.is_main:  # the curves")
    assert guarded_by_rank != source
    unguarded.write_text(guarded_by_rank)
    assert [line.split(": ")[1] for line in unguarded_calls(unguarded)] == ["report.draw_plots()"]


# The `with` and `try` blocks a launcher's epoch loop runs in, from the function that starts the
# process (main(), the spawn launcher's worker()) through train(): the process group's teardown.
DEPTH = {"train_multi_gpu_using_launch.py": 1, "train_single_gpu.py": 0, "train_multi_gpu_using_spawn.py": 1}


def loop_depth(source: str) -> int:
    """The `with` and `try` statements around train()'s `for epoch` loop, and around the call of
    train() in the function that makes it."""
    defs = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    loop = next(n for n in ast.walk(defs["train"]) if isinstance(n, ast.For) and ast.unparse(n.target) == "epoch")
    caller, call = next((f, n) for f in defs.values() for n in ast.walk(f)
                        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "train")

    def around(function: ast.FunctionDef, target: ast.AST) -> int:
        return sum(isinstance(n, (ast.With, ast.Try)) and within(n, target) for n in ast.walk(function))
    return around(defs["train"], loop) + around(caller, call)


@pytest.mark.parametrize("launcher", sorted(DEPTH))
def test_the_epoch_loop_runs_in_few_with_and_try_blocks(launcher):
    assert loop_depth((REPO / launcher).read_text()) <= DEPTH[launcher]


def test_the_depth_sees_a_block_more():
    source = (REPO / LAUNCHER).read_text()
    wrapped = source.replace("        train(plan, ctx, output_dir)\n",
                             "        with nullcontext():\n            train(plan, ctx, output_dir)\n")
    assert wrapped != source and loop_depth(wrapped) == loop_depth(source) + 1
