"""What a reader must read to follow a default run, from the records tests/default_run/sitecustomize.py
wrote (one PID.jsonl per process of the job):

    python tests/default_run/count.py TRACE_DIR [--root REPO] [--launcher train_multi_gpu_using_launch.py]

The count's rules: every project function that runs in any process or thread of the job counts
whole (its decorators, docstring, comments and blank lines too: a reader cannot skip a branch
without reading it); module-level statements that run also count, and a class body's statements
(its fields) once the class is used: one of its methods ran, or its generated __init__ (a
dataclass's) made one; imports, definitions and docstrings do not. A lambda or comprehension counts the function around it whole
(at module level, the statement that holds it). A line counts once however many spans hold it.

Also here, each returning a list of violations (empty: none): size_violations (at most so many
lines in so many files), collective_violations (where each collective is made, below the
launcher) and start_violations (threads and processes that outlive the project code that started
them)."""
from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
LAUNCHER = "train_multi_gpu_using_launch.py"
DISTRIBUTED_UTILS = "multi_train_utils/distributed_utils.py"
# The names code objects get that are not a def's or a class's.
ANONYMOUS = {"<lambda>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}
# Where the threads and processes that libraries start for themselves are started from (the module
# of a frame between the project's innermost frame and the start): DataLoader's workers (and its
# fork server), TensorBoard's writer thread and tqdm's monitor thread.
EXEMPT_STARTERS = ("torch.utils.data", "torch.utils.tensorboard", "tensorboard", "tqdm")


@dataclass
class Trace:
    first_calls: set[tuple[str, int, str]] = field(default_factory=set)  # (file, co_firstlineno, co_name)
    classes_made: set[tuple[str, str]] = field(default_factory=set)  # (file, qualname): by a generated __init__
    collectives: list[dict] = field(default_factory=list)  # distinct: {"name", "chain", "pids"}
    starts: list[dict] = field(default_factory=list)  # distinct: {"kind", "chain", "via", "target", "outlived", "pids"}
    processes: int = 0


def read_trace(folder: str | Path) -> Trace:
    trace = Trace()
    starts: dict[str, dict] = {}
    outlived: dict[str, bool | None] = {}
    collectives: dict[tuple, dict] = {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        trace.processes += 1
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a process killed in the middle of a write
                continue
            kind = record.get("type")
            if kind == "first_call":
                trace.first_calls.add((record["file"], record["line"], record["name"]))
            elif kind == "class_used":
                trace.classes_made.add((record["file"], record["name"]))
            elif kind == "collective":
                key = (record["name"], json.dumps(record["chain"]))
                collectives.setdefault(key, {"name": record["name"], "chain": record["chain"], "pids": set()})
                collectives[key]["pids"].add(record["pid"])
            elif kind == "start":
                starts[record["id"]] = record
            elif kind == "outlived":
                outlived[record["id"]] = record["outlived"]
    trace.collectives = list(collectives.values())
    distinct: dict[tuple, dict] = {}
    for start_id, record in starts.items():
        if record["kind"] in ("thread", "process"):
            # Never told: its starter never returned (the process ended first), so it outlived it.
            gone = outlived.get(start_id, "never returned")
        else:
            gone = "unknown"
        key = (record["kind"], json.dumps(record["chain"]), json.dumps(record["via"]), record.get("target"), str(gone))
        entry = distinct.setdefault(key, {"kind": record["kind"], "chain": record["chain"], "via": record["via"],
                                          "target": record.get("target"), "outlived": gone, "pids": set()})
        entry["pids"].add(record["pid"])
    trace.starts = list(distinct.values())
    return trace


# --- the count -------------------------------------------------------------------------------

def _first_line(node: ast.AST) -> int:
    decorators = getattr(node, "decorator_list", None)
    return decorators[0].lineno if decorators else node.lineno


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _span(node: ast.AST) -> set[int]:
    return set(range(_first_line(node), node.end_lineno + 1))


DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class _File:
    """One project file's definitions, by (name, first line), with their qualified names."""

    def __init__(self, path: Path):
        self.tree = ast.parse(path.read_text(), str(path))
        self.defs: dict[tuple[str, int], tuple[ast.AST, str]] = {}
        self.functions: list[ast.AST] = []

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, DEFS):
                    qualname = prefix + child.name
                    self.defs[(child.name, _first_line(child))] = (child, qualname)
                    if not isinstance(child, ast.ClassDef):
                        self.functions.append(child)
                    visit(child, qualname + ("." if isinstance(child, ast.ClassDef) else ".<locals>."))
                else:
                    visit(child, prefix)

        visit(self.tree, "")

    def module_lines(self) -> set[int]:
        return self._body_lines(self.tree.body)

    @staticmethod
    def _body_lines(body: list[ast.stmt]) -> set[int]:
        lines: set[int] = set()
        for i, stmt in enumerate(body):
            if isinstance(stmt, (ast.Import, ast.ImportFrom) + DEFS) or (i == 0 and _is_docstring(stmt)):
                continue
            lines |= _span(stmt)
        return lines

    def code_lines(self, name: str, line: int) -> tuple[set[int], str | None, str]:
        """The lines a code object of this file counts, the function it is (or None) and what it is."""
        if name == "<module>":
            return self.module_lines(), None, "module"
        if name in ANONYMOUS:
            around = [f for f in self.functions if _first_line(f) <= line <= f.end_lineno]
            if around:
                inner = max(around, key=_first_line)
                return _span(inner), None, "anonymous"
            body = self.tree.body
            while True:  # the statement that holds it, at module level or in a class body
                holder = next((s for s in body if _first_line(s) <= line <= s.end_lineno), None)
                if holder is None:
                    return set(), None, "unmatched"
                if not isinstance(holder, ast.ClassDef):
                    return _span(holder), None, "anonymous"
                body = holder.body
        found = self.defs.get((name, line))
        if found is None:
            return set(), None, "unmatched"
        node, qualname = found
        if isinstance(node, ast.ClassDef):
            return self._body_lines(node.body), qualname, "class body"
        return _span(node), qualname, "function"


@dataclass
class Count:
    lines: dict[str, set[int]]  # per file: the line numbers counted
    functions: list[tuple[str, str, int]]  # (qualified name, file, lines), longest first
    unmatched: list[tuple[str, int, str]]  # first calls no definition of today's files matches

    def per_file(self) -> dict[str, int]:
        return {f: len(lines) for f, lines in self.lines.items() if lines}

    @property
    def total(self) -> int:
        return sum(self.per_file().values())


def count(trace: Trace, root: str | Path = REPO) -> Count:
    root = Path(root)
    files: dict[str, _File] = {}
    lines: dict[str, set[int]] = {}
    functions: dict[tuple[str, str], int] = {}
    unmatched = []
    class_bodies: list[tuple[str, str, set[int]]] = []  # counted once the class is used
    for file, line, name in sorted(trace.first_calls):
        if file not in files:
            try:
                files[file] = _File(root / file)
            except (OSError, SyntaxError, ValueError):
                unmatched.append((file, line, name))
                continue
        counted, qualname, what = files[file].code_lines(name, line)
        if what == "unmatched":
            unmatched.append((file, line, name))
        if what == "class body":
            class_bodies.append((file, qualname, counted))
            continue
        lines.setdefault(file, set()).update(counted)
        if qualname is not None:
            functions[(qualname, file)] = len(counted)
    for file, qualname, counted in class_bodies:
        used = (file, qualname) in trace.classes_made or any(
            f == file and q.startswith(qualname + ".") for q, f in functions)
        if used:
            lines.setdefault(file, set()).update(counted)
    longest = sorted(((q, f, n) for (q, f), n in functions.items()), key=lambda t: (-t[2], t[1], t[0]))
    return Count(lines, longest, unmatched)


def table(counted: Count) -> str:
    per_file = sorted(counted.per_file().items(), key=lambda item: (-item[1], item[0]))
    rows = ["| file | lines |", "|---|---:|"] + [f"| {f} | {n} |" for f, n in per_file]
    rows.append(f"| total ({len(per_file)} files) | {counted.total} |")
    return "\n".join(rows)


# --- the limits --------------------------------------------------------------------------------

def _chain(chain: list) -> str:
    return " → ".join(f"{file}:{function}:{line}" for file, function, line in chain)


def size_violations(counted: Count, max_lines: int = 1000, max_files: int = 10) -> list[str]:
    found = []
    if counted.total > max_lines:
        found.append(f"{counted.total} lines counted, more than {max_lines}")
    if len(counted.per_file()) > max_files:
        found.append(f"{len(counted.per_file())} files counted, more than {max_files}")
    return found


def collective_violations(trace: Trace, launcher: str = LAUNCHER) -> list[str]:
    """Each collective's project frames must be the launcher's, then at most one project function
    below the launcher, which may itself call one helper in multi_train_utils/distributed_utils.py.
    (Project frames above the launcher's innermost, a decorator's wrapper of main, do not matter.)"""
    found = []
    for record in sorted(trace.collectives, key=lambda r: (_chain(r["chain"]), r["name"])):
        chain = record["chain"]
        ours = [i for i, frame in enumerate(chain) if frame[0] == launcher]
        if not ours:
            found.append(f"{record['name']} not made under the launcher: {_chain(chain)}")
            continue
        below = chain[ours[-1] + 1:]
        if len(below) <= 1 or (len(below) == 2 and below[1][0] == DISTRIBUTED_UTILS):
            continue
        found.append(f"{record['name']} made {len(below)} calls below the launcher: {_chain(chain)}")
    return found


def exempt(start: dict) -> bool:
    """A library's own thread or process, started by it between the project's code and the start:
    DataLoader's and TensorBoard's, or any library's as it is imported (torch runs ldconfig)."""
    return any(module == prefix or module.startswith(prefix + ".")
               for module, _, _ in start["via"] for prefix in EXEMPT_STARTERS + ("importlib",))


def _via(start: dict, lines: bool = False) -> str:
    """The frames between the project's innermost and the start, less an import's machinery."""
    return " → ".join(f"{module}.{function}" + (f":{line}" if lines else "") for module, function, line in start["via"]
                      if not module.startswith("importlib")) or "-"


def start_violations(trace: Trace, launcher: str = LAUNCHER) -> list[str]:
    """Each thread or process the project started, but the launcher's own and the exempt libraries',
    must have ended by the time the innermost project frame that started it returned (for os.fork,
    subprocess.Popen and fork_exec that is not known, which counts as a violation)."""
    found = []
    for start in sorted(trace.starts, key=lambda s: (_chain(s["chain"]), s["kind"])):
        if exempt(start) or start["chain"][-1][0] == launcher or start["outlived"] is False:
            continue
        via = _via(start)
        found.append(f"{start['kind']} {start['target']} outlived ({start['outlived']}) its starter, in "
                     f"{len(start['pids'])} process(es): {_chain(start['chain'])} [via {via}]")
    return found


# --- the command line ----------------------------------------------------------------------------

def report(trace: Trace, counted: Count, launcher: str = LAUNCHER, top: int = 15) -> str:
    out = [table(counted), "", f"{trace.processes} processes traced", "",
           f"The {top} longest functions counted:", "| function | file | lines |", "|---|---|---:|"]
    out += [f"| {q} | {f} | {n} |" for q, f, n in counted.functions[:top]]
    if counted.unmatched:
        out += ["", "Called, but matched to no definition (not counted):"]
        out += [f"  {f}:{line} {name}" for f, line, name in counted.unmatched]
    out += ["", "Collectives (distinct chains of project frames, outermost first):"]
    out += [f"  {r['name']} (ranks' pids {sorted(r['pids'])}): {_chain(r['chain'])}"
            for r in sorted(trace.collectives, key=lambda r: (_chain(r["chain"]), r["name"]))]
    out += ["", "Threads and processes started under project code:"]
    for s in sorted(trace.starts, key=lambda s: (_chain(s["chain"]), s["kind"])):
        out.append(f"  {s['kind']} {s['target']} outlived={s['outlived']} exempt={exempt(s)} "
                   f"({len(s['pids'])} process(es)): {_chain(s['chain'])} [via {_via(s, lines=True)}]")
    for title, found in (("size", size_violations(counted)), ("collectives", collective_violations(trace, launcher)),
                         ("threads and processes", start_violations(trace, launcher))):
        out += ["", f"Violations, {title}: {len(found)}"] + [f"  - {v}" for v in found]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--root", default=str(REPO), help="the project the trace was taken of (default: this one)")
    parser.add_argument("--launcher", default=LAUNCHER, help="the launcher's path relative to the root")
    args = parser.parse_args(argv)
    trace = read_trace(args.trace_dir)
    print(report(trace, count(trace, args.root), args.launcher))
    return 0


if __name__ == "__main__":
    sys.exit(main())
