"""The house's shape: each folder is a part of the plan, and imports flow one way, down this list.

    entry scripts        train_*.py, predict.py, export.py, make_sample.py, benchmarks/
    cluster/             what a cluster does to a run: the rendezvous of srun's tasks and the spawn
                         launcher's, preemption, --check
    outputs/             what a run leaves beyond its checkpoints: the report, the plots, the
                         scaling summary, the collective trace, the exported model
    recipe/  speed/      the recipe's options (budget, EMA, mixing, BatchNorm recalibration;
                         extras.py, which sets them up for the launchers) and the speed-ups (CUDA
                         graph, GPU decoding, the image cache, augmentation on the device), one
                         layer: recipe/extras.py uses speed/
    multi_train_utils/   the data-parallel core the tour walks: the command line, the run folder,
                         the training step and the exact evaluation, the checkpoint and resuming,
                         the loaders' fork server; it imports none of the packages above
    multi_train_utils/distributed_utils.py
                         the process group, the distributed state as a value and the collective
                         helpers: the rest of the core builds on them, they on no other of it
    model.py  my_dataset.py  plots.py     know nothing of processes or launchers
    utils.py             files, images, errors

A module may import its own layer or the ones below. No module imports an entry script or
another package's `_private` names, and there are no cycles. A new module or package must be
given a layer here, which is the moment to decide where it belongs.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from conftest import PACKAGES, REPO

ENTRY_SCRIPTS = {"train_single_gpu", "train_multi_gpu_using_launch", "train_multi_gpu_using_spawn", "predict", "export",
                 "make_sample"}
LAYERS = {"utils": 0, "model": 1, "my_dataset": 1, "plots": 1, "multi_train_utils.distributed_utils": 2,
          "multi_train_utils": 3, "recipe": 4, "speed": 4, "outputs": 5, "cluster": 6, "benchmarks": 7,
          **{name: 7 for name in ENTRY_SCRIPTS}}


def project_modules(root: Path = REPO) -> dict[str, str]:
    """Dotted module name -> source, for every module of the project (tests excluded)."""
    files = [*root.glob("*.py"), *(path for package in PACKAGES for path in root.glob(f"{package}/*.py"))]
    modules = {}
    for path in files:
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path.read_text()
    return modules


def layer(module: str) -> int:
    for name in (module, module.split(".")[0]):
        if name in LAYERS:
            return LAYERS[name]
    raise AssertionError(f"{module} has no layer: add it to LAYERS in tests/test_layout.py")


@functools.lru_cache(maxsize=None)
def tree_of(source: str) -> ast.Module:
    """The tree of a module's source, parsed once (the callers only read it)."""
    return ast.parse(source)


def imports(module: str, source: str, known: set[str]) -> list[tuple[str, list[str], int]]:
    """(imported project module, names taken from it, line) for every import in `source`."""
    found = []
    package = module if module in {m.split(".")[0] for m in known if "." in m} else module.rpartition(".")[0]
    for node in ast.walk(tree_of(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from .x import y
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    found.append((submodule, [], node.lineno))
                else:
                    found.append((base, [alias.name], node.lineno))
    return [(name, names, line) for name, names, line in found if name in known]


def private_attributes(source: str, known: set[str]) -> list[tuple[str, int]]:
    """`module._name` uses, where `module` was bound by `import module` (or `import module as m`)."""
    aliases = {}
    tree = tree_of(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    aliases[alias.asname or alias.name] = alias.name
    return [(f"{aliases[node.value.id]}.{node.attr}", node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def violations(modules: dict[str, str]) -> list[str]:
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    problems = []
    for module, source in modules.items():
        for imported, names, line in imports(module, source, known):
            where = f"{module}:{line} imports {imported}"
            same_package = imported.split(".")[0] == module.split(".")[0]
            if imported.split(".")[0] in ENTRY_SCRIPTS:
                problems.append(f"{where}, an entry script")
            elif layer(imported) > layer(module):
                problems.append(f"{where}, a layer above it")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and not same_package:
                problems.append(f"{where}'s private {', '.join(private)}")
            if imported != module:
                graph[module].add(imported)
        problems += [f"{module}:{line} uses the private {name}" for name, line in private_attributes(source, known)]
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected part of the graph that has one."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for start in sorted(graph):
        visit(start, [])
    return found


def test_the_project_imports_only_downward():
    modules = project_modules()
    assert {"utils", "model", "my_dataset", "plots", "multi_train_utils.train_eval_utils",
            "train_single_gpu"} <= modules.keys()
    assert violations(modules) == []


def with_change(module: str, extra: str) -> dict[str, str]:
    modules = project_modules()
    modules[module] = modules.get(module, "") + "\n" + extra + "\n"
    return modules


@pytest.mark.parametrize("module, line, complaint", [
    # The kinds of import this layout exists to prevent, each one the project once had.
    ("model", "from multi_train_utils.checkpoint import why_unloadable", "a layer above it"),
    ("my_dataset", "from multi_train_utils.distributed_utils import DistContext, broadcast_object", "a layer above it"),
    ("utils", "import model", "a layer above it"),
    ("benchmarks", "from train_multi_gpu_using_spawn import stop", "an entry script"),
    ("multi_train_utils.checkpoint", "import predict", "an entry script"),
    ("benchmarks", "from plots import _not_public", "private _not_public"),
    ("multi_train_utils.config", "import my_dataset\nx = my_dataset._secret", "uses the private my_dataset._secret"),
    ("multi_train_utils.checkpoint", "from outputs.report import draw_plots", "a layer above it"),
    ("multi_train_utils.distributed_utils", "from recipe.budget import most_epochs", "a layer above it"),
    ("multi_train_utils.train_eval_utils", "from speed.cuda_graph import graphed_step", "a layer above it"),
    ("multi_train_utils.resume", "from cluster.rendezvous import srun_ranks", "a layer above it"),
    ("multi_train_utils.distributed_utils", "from multi_train_utils.checkpoint import save_atomic", "a layer above it"),
    ("recipe.extras", "from outputs.scaling import ddp_timers", "a layer above it"),
    ("outputs.report", "from cluster.preemption import save_position_and_exit", "a layer above it"),
    ("multi_train_utils.checkpoint", "from multi_train_utils import config", "import cycle"),
    ("speed.cuda_graph", "from recipe.extras import training_extras", "import cycle"),
])
def test_each_kind_of_wrong_import_is_caught(module, line, complaint):
    problems = violations(with_change(module, line))
    assert any(complaint in p for p in problems), problems


def test_a_module_without_a_layer_is_caught():
    modules = {**project_modules(), "newthing": "import utils\n"}
    with pytest.raises(AssertionError, match="newthing has no layer"):
        violations(modules)


def test_every_package_of_the_project_has_a_layer():
    """A folder of Python modules at the top is a package of the plan, or a place outside it;
    tests/conftest.py's PACKAGES lists them in the order of their layers, lowest first."""
    outside = {"tests", "docs", "data", "runs"}
    folders = {path.parent.name for path in REPO.glob("*/*.py")} - outside
    assert folders <= set(PACKAGES), f"{sorted(folders - set(PACKAGES))}: add to PACKAGES and LAYERS"
    assert [layer(package) for package in PACKAGES] == sorted(layer(package) for package in PACKAGES)


def test_the_readmes_layout_names_every_package_and_module():
    """The README's layout table names every package and every module in it (a reader who opens
    a folder finds each file there, and what it is for)."""
    layout = (REPO / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    missing = [f"{package}/{f.name}" for package in PACKAGES if package != "benchmarks"
               for f in sorted((REPO / package).glob("*.py"))
               if f.name != "__init__.py" and f"`{f.name}`" not in layout and f"/{f.name}`" not in layout]
    missing += [f"{package}/" for package in PACKAGES if f"`{package}/`" not in layout]
    assert not missing, f"README's layout table leaves out {missing}"


MOST_LINES = 450  # a file a reader can hold in mind; past it, a feature wants a module of its own


def test_no_file_grows_past_450_lines():
    """Every Python file of the repository, the tests' too."""
    elsewhere = {".git", ".venv", "venv", "site-packages", "runs"}
    files = [path for path in REPO.rglob("*.py") if not elsewhere & set(path.parts)]
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert files and not long, long
