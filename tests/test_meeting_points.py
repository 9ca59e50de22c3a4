"""Where the ranks meet, read from the code (ast): every line of a launcher that makes a
collective, or calls project code that leads to one, says so in its comment, and the tour's
"Where the ranks meet" lists exactly those lines, in order. A rank that skips or reorders one of
them leaves the others waiting: this is the list a reader must be able to trust.

A call leads to a collective when the function it names (any project function or method of that
name) makes one of torch.distributed's collectives, constructs DistributedDataParallel (which
broadcasts rank 0's weights), joins the process group, or calls a function that leads to one.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

from test_layout import ENTRY_SCRIPTS, project_modules

# The single launcher has no process group: its calls of the same functions meet no one.
LAUNCHERS = ("train_multi_gpu_using_launch.py", "train_multi_gpu_using_spawn.py")
# torch.distributed's calls where every rank must meet (`dist.NAME`), and DDP's constructor.
COLLECTIVES = {"all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object", "gather",
               "gather_object", "reduce", "scatter", "all_to_all", "barrier", "init_process_group",
               "DistributedDataParallel", "DDP"}
# The words a launcher's comment uses to name the collective a line makes.
NAMED = re.compile(r"\b(all_reduce|all-reduce|broadcast|all_gather|gather|barrier|init_process_group)\b")
TOUR = REPO / "docs" / "how-it-works.md"


def called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def callee(call: ast.Call, modules: frozenset[str] = frozenset()) -> str | None:
    """What a call names: "f" for a function or class f called by name, or by its module's name
    (`resume.read_checkpoint(...)`, `modules`: the names bound to project modules where the call
    is), ".m" for a method m called on some object (its class unknown: every project method named m)."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
        return func.attr
    if isinstance(func, ast.Attribute) and not func.attr.startswith("__"):
        return "." + func.attr
    return None


def module_names(tree: ast.Module, known: set[str]) -> frozenset[str]:
    """The names a module binds to project modules: `from cluster import preemption`, `import utils`."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in known}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name in known and "." not in a.name}
    return frozenset(names)


def definitions(root: Path = REPO) -> dict[str, list[tuple[ast.AST, frozenset[str]]]]:
    """The functions ("f"), classes (a class called runs its __init__, and __enter__ and
    __exit__ in a with, __iter__ in a for: "C"; not __call__, which runs when an instance is
    called, later and by another name) and methods (".m") of the modules a launcher builds on: not the
    entry scripts, whose own functions are read where they are called, nor the benchmarks. Each
    with the names its module binds to project modules."""
    found: dict[str, list[tuple[ast.AST, frozenset[str]]]] = {}
    modules = project_modules(root)
    for module, source in modules.items():
        if module.split(".")[0] in ENTRY_SCRIPTS | {"benchmarks"}:
            continue
        tree = ast.parse(source)
        bound = module_names(tree, set(modules))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append((node, bound))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if not isinstance(member, ast.FunctionDef):
                        continue
                    if member.name in ("__init__", "__enter__", "__exit__", "__iter__"):
                        found.setdefault(node.name, []).append((member, bound))
                    elif not member.name.startswith("__"):
                        found.setdefault("." + member.name, []).append((member, bound))
    return found


def leading_to_collectives(root: Path = REPO) -> set[str]:
    """What makes a collective or leads to one: the names of definitions() that do, and, for a
    method, the name without its dot too (as the launchers and the tour write it)."""
    defs = definitions(root)
    calls = {name: {callee(c, bound) for node, bound in nodes for c in ast.walk(node) if isinstance(c, ast.Call)}
             - {None} for name, nodes in defs.items()}
    leading = {name for name, names in calls.items() if {n.lstrip(".") for n in names} & COLLECTIVES}
    while True:
        more = {name for name, names in calls.items() if names & leading} - leading
        if not more:
            return leading | {name.lstrip(".") for name in leading}
        leading |= more


def launcher_functions(path: Path) -> list[ast.FunctionDef]:
    return [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]


def meeting_lines(path: Path, leading: set[str]) -> list[tuple[int, str]]:
    """(line, name of the call) of each call in the launcher that makes a collective or leads to
    one, in the order of the file; calls of the launcher's own functions are read where they are."""
    own = {f.name for f in launcher_functions(path)}
    tree = ast.parse(path.read_text())
    alias = {a.asname: a.name.rpartition(".")[2] for n in tree.body
             if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names if a.asname}  # DDP: DistributedDataParallel
    bound = module_names(tree, set(project_modules()))  # resume.read_checkpoint(...) calls read_checkpoint
    found = []
    for function in launcher_functions(path):
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and (name := callee(node, bound)) and name not in own:
                if name.lstrip(".") in COLLECTIVES or name in leading:
                    found.append((node.lineno, alias.get(name, name).lstrip(".")))
    return sorted(set(found))


def comment_of(lines: list[str], lineno: int) -> str:
    """The comment on a line of code, with the comment lines just above it; for a line in an
    `if`'s condition or body, the `if` line's comment and those above it too (`if args.resume:  #
    broadcast ...` says what the call in its body makes), and for a call in the condition, the
    comment of a body of one statement (`break  # broadcast: ...`)."""
    def own(n: int) -> str:
        text, above = lines[n - 1].partition("#")[2], n - 2
        while above >= 0 and lines[above].strip().startswith("#"):
            text = lines[above].strip() + " " + text
            above -= 1
        return text

    text = own(lineno)
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, ast.If):
            continue
        in_test = node.test.lineno <= lineno <= node.test.end_lineno
        in_body = node.body[0].lineno <= lineno <= node.body[-1].end_lineno
        if (in_test or in_body) and node.lineno != lineno:
            text += " " + own(node.lineno)
        if in_test and len(node.body) == 1:
            text += " " + own(node.body[0].lineno)
    return text


def tour_table(text: str) -> list[tuple[str, str]]:
    """The tour's "Where the ranks meet" table, in order: each row's call (its first column)
    and the collectives it names (its second)."""
    section = re.search(r"^## Where the ranks meet.*?(?=^## )", text, flags=re.M | re.S)
    assert section, "the tour has a section \"Where the ranks meet\""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in section[0].splitlines()
             if line.startswith("| `")]
    return [(re.match(r"`([\w.]+)\(", row[0])[1].rpartition(".")[2], row[1]) for row in cells]


def tour_rows(text: str) -> list[str]:
    """The calls the tour's "Where the ranks meet" table lists, in order."""
    return [call for call, _ in tour_table(text)]


@pytest.fixture(scope="module")
def leading() -> set[str]:
    return leading_to_collectives()


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_line_where_the_ranks_meet_says_which_collective(launcher, leading):
    path = REPO / launcher
    lines = path.read_text().splitlines()
    silent = [f"{launcher}:{n}: {name}() leads to a collective; its comment does not say which"
              for n, name in meeting_lines(path, leading) if not NAMED.search(comment_of(lines, n))]
    assert silent == []


def test_the_tour_lists_the_torchrun_launchers_meeting_points_in_order(leading):
    listed = tour_rows(TOUR.read_text())
    in_code = [name for _, name in meeting_lines(REPO / "train_multi_gpu_using_launch.py", leading)]
    assert listed == in_code


def test_the_spawn_launcher_meets_where_the_torchrun_launcher_does(leading):
    """Its worker() and train() make the same calls that lead to collectives, in the same order."""
    def calls(launcher: str) -> list[str]:
        return [name for _, name in meeting_lines(REPO / launcher, leading)]

    assert calls("train_multi_gpu_using_spawn.py") == calls("train_multi_gpu_using_launch.py")


def test_what_leads_to_a_collective_is_found_and_what_does_not_is_not(leading):
    """The analysis itself: functions known to meet are found, through the calls between
    (train_one_epoch reaches dist.all_reduce through all_reduce_sum), and known local ones are not."""
    assert {"train_one_epoch", "evaluate", "create_run_folder", "read_checkpoint", "checked_split", "decoded_once",
            "job_precision", "evaluate_only", "report_on_best", "next_epoch_fits", "broadcast_buffers",
            "save_position_and_exit", "all_reduce_sum", "broadcast_object", "check"} <= leading
    assert not {"create_model", "build_optimizer", "restore_training", "finish_epoch", "write_epoch", "epoch_record",
                "save_checkpoint", "make_checkpoint", "write_run_files", "cpu_sync_batchnorm", "list_images_of",
                "check_options", "split_samples", "loader_options", "training_extras", "job_store",
                "meeting_point", "join_processes"} & leading


def test_a_call_through_its_module_and_a_comment_on_its_if_are_read():
    """The launchers call most of what meets through its module (`resume.read_checkpoint(...)`)
    and say what it makes on the `if` that guards it: both are read, and a call of a project
    function by its module's name leads where the function does."""
    launcher = REPO / "train_multi_gpu_using_launch.py"
    calls = dict((name, n) for n, name in meeting_lines(launcher, leading_to_collectives()))
    assert {"read_checkpoint", "next_epoch_fits", "save_position_and_exit", "report_on_best"} <= calls.keys()
    lines = launcher.read_text().splitlines()
    assert "broadcast" in comment_of(lines, calls["read_checkpoint"])  # the `if args.resume:` line's
    assert "broadcast" in comment_of(lines, calls["next_epoch_fits"])  # its `break`'s


def test_a_line_that_stops_saying_so_or_a_list_that_misses_one_is_caught(leading, tmp_path):
    """A copy of the torchrun launcher whose budget line lost its comment, and a tour without its
    evaluation row."""
    launcher = (REPO / "train_multi_gpu_using_launch.py").read_text()
    comment = "# broadcast: rank 0's clock decides"
    assert comment in launcher
    stripped = tmp_path / "launcher.py"
    stripped.write_text(launcher.replace(comment, "# rank 0's clock decides"))
    lines = stripped.read_text().splitlines()
    assert any(name == "next_epoch_fits" and not NAMED.search(comment_of(lines, n))
               for n, name in meeting_lines(stripped, leading))
    rows = tour_rows(TOUR.read_text())
    assert rows.count("evaluate") == 1
    without = TOUR.read_text().replace(next(line for line in TOUR.read_text().splitlines()
                                            if line.startswith("| `evaluate(")) + "\n", "")
    assert tour_rows(without) != [name for _, name in meeting_lines(REPO / "train_multi_gpu_using_launch.py", leading)]


def test_a_function_that_stops_meeting_is_dropped_from_the_list(tmp_path):
    """The code in a copy where evaluate no longer all-reduces or broadcasts: it no longer leads
    to a collective, so the tour's row for it would be caught as one too many."""
    for name, source in project_modules().items():
        path = tmp_path / (name.replace(".", "/") + (".py" if not name.endswith("benchmarks") else "/__init__.py"))
        path.parent.mkdir(parents=True, exist_ok=True)
        if name == "multi_train_utils.train_eval_utils":
            tree = ast.parse(source)
            body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "evaluate")
            body.body = [ast.Return(value=ast.Constant(value=None))]
            source = ast.unparse(tree)
        path.write_text(source)
    assert "evaluate" in leading_to_collectives()
    assert "evaluate" not in leading_to_collectives(tmp_path)
