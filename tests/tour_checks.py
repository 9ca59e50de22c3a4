"""The checks that keep docs/how-it-works.md true (tests/test_how_it_works.py runs them): what
it names exists, and what it tells a reader to run parses.

The page's conventions, which these checks enforce:
- the page opens with "What a default run executes": a table of the lines a default torchrun run
  executes per file (tests/test_default_run.py measures them), whose total row adds them up;
  then the nine stops, 1 to 9, then the reference (skeleton, rule, meeting points, map);
- a backticked span ending in `.py` is a file of the repository;
- `name()`, `ClassName`, `ClassName.member` and `module.NAME` are defined in the project's code
  (found with ast, not imported), and "`name()` in `path.py`" says in which file;
- a backticked `torch.` name exists in the installed PyTorch; plain lower-case words and
  ALL_CAPS names (environment variables) are not code names and are not checked;
- every ```bash line that starts a launcher (python X.py, torchrun ... X.py, python -m
  torch.distributed.launch ... X.py) parses with that launcher's own parser, and torchrun's
  options with torchrun's, all in this process: nothing trains; outside the opening (whose
  command is the measured default run, on a folder it names `PHOTOS`), it runs on a laptop's
  CPU: the bundled sample, --device cpu;
- every line of an ```output block (what our launchers print) matches a string in the code: an
  f-string's fields match anything, but a field built from string constants (`'fp32' if x else
  y + ' autocast'`) fixes them too, so that a short label (`precision: `) is not all a line has
  to match; a block without an info string (PyTorch's log, a one-liner's print) is not checked;
  a block that leaves out lines a run prints between two it shows has a line `...` there
  (RUN_LINES);
- a ```text block (the map of calls) names functions and files by the same rules, and each
  indented call is made in the body of the call above it, after its previous sibling's (ast);
- each row of the skeleton's table names a call and "`function()` in `path.py`" that makes it;
- every project name on the page is given with its file at least once: "`name` in `path.py`",
  "`name` (same file)" or "(`name`, same file)" after another name's file, or a line of the map;
- links to other pages lead to a file and heading that exist.
"""
from __future__ import annotations

import ast
import builtins
import functools
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

from command_checks import blocks, command_problems, commands
from conftest import PACKAGES, REPO

PAGE = REPO / "docs" / "how-it-works.md"
FILE_ENDINGS = (".py", ".pth", ".json", ".jsonl", ".csv", ".png", ".md", ".txt")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?")
# "`name()` in `path.py`", also "`Name` (in `path.py`)" and "`name()` (`path.py`)"
IN_FILE = re.compile(r"`([^`]+)`\s+(?:\(\s*)?(?:in\s+)?`([\w/.-]+\.py)`")
# "`name()` (same file)" or "(`name()`, same file)": the file named last before it
SAME_FILE = re.compile(r"`([^`]+)`(?:\s+\(|,\s*)same\s+file\b")
# A line of the map: its indent, the call, and the files named after it.
MAP_CALL = re.compile(r"^( *)([A-Za-z_][\w.]*)\(\)")
CUT = "..."  # the line that stands for lines an output block leaves out
# The lines every training run prints on rank 0, in this order (an epoch line per epoch); the
# report's line (--report) comes between the last epoch's and done:'s only when asked for.
RUN_LINES = (r"process group: ", r"config: ", r"\w+: \d+ process\(es\) on ", r"\d+ images in \d+ classes",
             r"precision: ", r"training: epoch ", r"epoch \d+/\d+: ", r"done: ")
# The opening section: what a default torchrun run executes, file by file.
DEFAULT_RUN = "What a default run executes"
MIN_LITERAL = 12  # characters a code string must fix for an output line to count as matching it


def source_files(root: Path) -> list[Path]:
    """The project's Python files, the tests and their helpers included (a page may name a test)."""
    return [*root.glob("*.py"), *(path for package in PACKAGES for path in root.glob(f"{package}/*.py")),
            *root.glob("tests/**/*.py")]


class Code:
    """What the project's source defines, read with ast: names and members per file."""

    def __init__(self, root: Path = REPO):
        self.root = root
        self.top: dict[str, set[str]] = {}  # file -> names defined at its top level
        self.anywhere: dict[str, set[str]] = {}  # function or class name -> files
        self.members: dict[str, set[str]] = {}  # "Class.member" -> files
        self.patterns: list[re.Pattern] = []  # the strings the program code can print
        for path in source_files(root):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            self.top[rel] = {name for node in tree.body for name in _defined(node)}
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.anywhere.setdefault(node.name, set()).add(rel)
                if isinstance(node, ast.ClassDef):
                    for member in (name for child in node.body for name in _defined(child)):
                        self.members.setdefault(f"{node.name}.{member}", set()).add(rel)
            if not rel.startswith("tests/"):
                self.patterns += _printable(tree)

    def module_files(self, dotted: str) -> list[str]:
        """Files that `dotted` names as a module: `train_eval_utils` or `multi_train_utils.train_eval_utils`."""
        return [f for f in self.top if ("." + f.removesuffix(".py").replace("/", ".")).endswith("." + dotted)]


def _defined(node: ast.stmt) -> Iterator[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, ast.Assign):  # also `A, B = 1, 2`
        yield from (n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        yield node.target.id


def _field(node: ast.expr) -> tuple[str, int]:
    """An f-string field's pattern and the characters it fixes: what its string constants fix
    (`'fp32' if x else str(y) + ' autocast'`: fp32, or anything then " autocast"), else anything."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value), len(node.value)
    if isinstance(node, ast.IfExp):
        (yes, fixed_yes), (no, fixed_no) = _field(node.body), _field(node.orelse)
        return f"(?:{yes}|{no})", min(fixed_yes, fixed_no)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        (left, fixed_left), (right, fixed_right) = _field(node.left), _field(node.right)
        return left + right, fixed_left + fixed_right
    if isinstance(node, ast.FormattedValue) and node.format_spec is None and node.conversion == -1:
        return _field(node.value)
    return ".*?", 0


def _printable(tree: ast.Module) -> list[re.Pattern]:
    """Each string constant and f-string of a module as a pattern, its fields matching anything
    but what string constants in them fix."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [(re.escape(v.value), len(v.value)) if isinstance(v, ast.Constant) else _field(v)
                     for v in node.values]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts = [(re.escape(node.value), len(node.value))]
        else:
            continue
        if sum(n for _, n in parts) >= MIN_LITERAL:
            pattern = "".join(p for p, _ in parts)
            # A field at the end takes the rest of the line, not (lazily) nothing.
            found.append(re.compile(pattern[:-1] if pattern.endswith(".*?") else pattern))
    return found


def prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def named(text: str) -> list[str]:
    """The code names of the page: its backticked spans, and the `name()`s and paths of its map."""
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose(text))]  # a span may wrap
    for block in blocks(text, "text"):
        spans += re.findall(r"[A-Za-z_][\w.]*\(\)|[\w/]+\.py\b", block)
    return spans


def torch_has(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def name_problem(span: str, code: Code) -> str | None:
    """Why a backticked span is not true of the code, or None (also for spans that are no name)."""
    if span.endswith(FILE_ENDINGS) and re.fullmatch(r"[\w/.-]+", span):
        if span.endswith(".py") and span not in code.top:
            return f"`{span}`: no such file"
        return None
    if not IDENTIFIER.fullmatch(span):
        return None  # an option, a log line, an environment variable setting, ...
    name = span.removesuffix("()")
    first, _, rest = name.partition(".")
    if first == "torch":
        return None if torch_has(name) else f"`{span}`: not in torch {importlib.import_module('torch').__version__}"
    if not rest:
        if span.endswith("()") or (name[0].isupper() and not name.isupper()):
            if name in code.anywhere or (not span.endswith("()") and hasattr(builtins, name)):
                return None
            return f"`{span}`: defined nowhere in the project"
        return None  # a plain lower-case word or an ALL_CAPS variable: not a code name by convention
    if first[0].isupper():  # Class.member
        return None if name in code.members else f"`{span}`: no such member"
    module, _, attr = name.rpartition(".")
    files = code.module_files(module)
    if not files:
        return f"`{span}`: `{first}` is neither torch, a project module nor a project class"
    return None if any(attr in code.top[f] for f in files) else f"`{span}`: not defined at the top of {module}"


def file_problems(text: str, code: Code) -> list[str]:
    """Each "`name` in `path.py`" whose name is not defined in that file."""
    problems = []
    for span, path in given_files(text):
        name = span.removesuffix("()")
        if not IDENTIFIER.fullmatch(span) or path not in code.top:
            continue
        if "." in name:
            if name not in code.members or path not in code.members[name]:
                problems.append(f"`{span}` is not defined in `{path}`")
        elif name not in code.top[path] and path not in code.anywhere.get(name, ()):
            problems.append(f"`{span}` is not defined in `{path}`")
    return problems


def map_lines(text: str) -> list[tuple[int, str, list[str]]]:
    """The map's calls: (indent, name without "()", the files on its line)."""
    return [(len(m[1]), m[2], re.findall(r"[\w/]+\.py\b", line)) for block in blocks(text, "text")
            for line in block.splitlines() if (m := MAP_CALL.match(line))]


def map_problems(text: str, code: Code) -> list[str]:
    """In the map of calls, each line's call must be defined in one of the files on that line."""
    problems = []
    for _, name, paths in map_lines(text):
        defined = (lambda p: p in code.members.get(name, ())) if "." in name else (lambda p: name in code.top.get(p, ()))
        if paths and not name.startswith("torch.") and not any(defined(p) for p in paths):
            problems.append(f"map: {name}() is in none of {', '.join(paths)}")
    return problems


@functools.lru_cache(maxsize=None)
def parsed(file: Path) -> tuple[ast.Module, dict[str, str]]:
    """A source file's tree (read once: the files do not change while the tests run; a test's
    changed copy is another path), and the names it imports under another name (`DDP`)."""
    tree = ast.parse(file.read_text())
    alias = {a.asname: a.name.rpartition(".")[2] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names if a.asname}
    return tree, alias


def function_node(root: Path, path: str, name: str) -> ast.FunctionDef | ast.ClassDef | None:
    """The definition of `name` (`function`, `Class` or `Class.method`) at the top of `path`."""
    file = root / path
    if not file.is_file():
        return None
    body: list[ast.stmt] = parsed(file)[0].body
    node = None
    for part in name.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


def references(root: Path, path: str, node: ast.AST) -> list[tuple[tuple[int, int], str]]:
    """Where the body of `node` calls a name or hands it on (a function given to a thread), as
    (where the call ends, the name), in the order they run: a call's arguments end before it.
    Names imported under another name (`DDP`) are given their own."""
    alias = parsed(root / path)[1]
    called = {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    found = []
    for n in ast.walk(node):
        target = n.func if isinstance(n, ast.Call) else n if id(n) not in called else None
        name = target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) else None
        if name and (isinstance(n, ast.Call) or isinstance(getattr(n, "ctx", None), ast.Load)):
            found.append(((n.end_lineno, n.end_col_offset), alias.get(name, name)))
    return sorted(found)


def map_order_problems(text: str, root: Path = REPO) -> list[str]:
    """Each indented call of the map must be made in the body of the call above it, after the
    call of its previous sibling: the map reads in the order the code runs."""
    problems = []
    lines = map_lines(text)
    for i, (indent, parent, paths) in enumerate(lines):
        children = []
        for child_indent, child, _ in lines[i + 1:]:
            if child_indent <= indent:
                break
            if not children or child_indent <= children[0][0]:
                children.append((child_indent, child))
        node = function_node(root, paths[0], parent) if paths and children else None
        if node is None:
            continue
        calls, after, previous = references(root, paths[0], node), (0, 0), None
        for _, child in children:
            short = child.rpartition(".")[2]
            at = next((where for where, name in calls if name == short and where > after), None)
            if at is None:
                order = f" after {previous}()" if previous and any(name == short for _, name in calls) else ""
                problems.append(f"map: {parent}() does not call {child}(){order}")
            else:
                after, previous = at, child
    return problems


def skeleton_rows(text: str) -> list[tuple[str, str, str]]:
    """The skeleton's table: (the call, the function that makes it, its file) per row."""
    section = re.search(r"^## The skeleton.*?(?=^## )", text, flags=re.M | re.S)
    rows = []
    for line in section[0].splitlines() if section else []:
        cells = line.split("|")[1:-1]
        if len(cells) == 3 and (call := re.fullmatch(r"\s*`([^`]+)`\s*", cells[0])):
            where = IN_FILE.search(cells[1])
            rows.append((call[1], *(where.groups() if where else ("", ""))))
    return rows


def skeleton_problems(text: str, root: Path = REPO) -> list[str]:
    """Each call of the skeleton is made in the function named beside it."""
    problems = []
    rows = skeleton_rows(text)
    if len(rows) < 12:
        problems.append(f"skeleton: {len(rows)} rows of `call` | `function()` in `file.py` | why")
    for call, function, path in rows:
        node = function_node(root, path, function.removesuffix("()")) if path else None
        short = call.removesuffix("()").rpartition(".")[2]
        if node is None:
            problems.append(f"skeleton: `{call}`: no function `{function}` in `{path}`")
        elif not any(name == short for _, name in references(root, path, node)):
            problems.append(f"skeleton: `{call}` is not called in `{function}`")
    return problems


def given_files(text: str) -> list[tuple[str, str]]:
    """(name, file) for each "`name` in `file.py`" and "`name` (same file)" of the prose, in order;
    "same file" is the file named last before it."""
    given, last = [], None
    for m in re.finditer(rf"{IN_FILE.pattern}|{SAME_FILE.pattern}|`([\w/.-]+\.py)`", prose(text)):
        if m[2]:
            given.append((m[1], m[2]))
            last = m[2]
        elif m[3] and last:
            given.append((m[3], last))
        elif m[4]:
            last = m[4]
    return given


def project_name(span: str, code: Code) -> str | None:
    """The project function or class a span names (a member's class), or None for anything else."""
    if not IDENTIFIER.fullmatch(span) or span.startswith("torch."):
        return None
    name = span.removesuffix("()")
    first = name.split(".")[0]
    if "." in name:
        return first if first[0].isupper() and name in code.members else None
    if name in code.anywhere and (span.endswith("()") or name[0].isupper()):
        return name
    return None


def unplaced_names(text: str, code: Code) -> list[str]:
    """Project names the page never gives with their file."""
    placed = {project_name(span, code) for span, _ in given_files(text)}
    placed |= {project_name(name + "()", code) for _, name, paths in map_lines(text) if paths}
    names = {n for span in named(text) if (n := project_name(span, code))}
    return [f"`{n}` is never given with its file" for n in sorted(names - placed)]


def output_problems(text: str, code: Code) -> list[str]:
    """Lines of output blocks that no string of the code prints: a line counts as printed when
    one string's pattern matches at least half of it (the rest may come from another string)."""
    def printed(line: str) -> bool:
        return any((m := p.search(line)) and m.end() - m.start() >= len(line) / 2 for p in code.patterns)

    return [f"output line printed by nothing in the code: {line}" for block in blocks(text, "output")
            for line in block.splitlines() if line.strip() not in ("", CUT) and not printed(line)]


def cut_problems(text: str) -> list[str]:
    """Output blocks that leave out lines a run prints between two they show, without a `...` there."""
    problems = []
    for block in blocks(text, "output"):
        shown, cut = None, False
        for line in block.splitlines():
            if line.strip() == CUT:
                cut = True
                continue
            at = next((i for i, start in enumerate(RUN_LINES) if re.match(start, line)), None)
            if at is None:
                continue
            if shown is not None and at > shown[0] + 1 and not cut:
                problems.append(f"output block cut without a `{CUT}` line between: {shown[1]}\n  and: {line}")
            shown, cut = (at, line), False
    return problems


def link_problems(text: str) -> list[str]:
    """Links to other pages of the repository whose file or heading is gone."""
    problems = []
    for target, anchor in re.findall(r"\]\(([^)#:\s]+)(?:#([^)\s]+))?\)", text):
        path = PAGE.parent / target
        if not path.is_file():
            problems.append(f"link to {target}: no such file")
        elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}:
            problems.append(f"link to {target}#{anchor}: no such heading")
    return problems


def _slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> list[tuple[str, str]]:
    """The page's `## ` sections, in order: (its heading's words, its text from the heading on)."""
    return [(part.split("\n", 1)[0], "## " + part) for part in re.split(r"^## ", text, flags=re.M)[1:]]


def default_run_rows(text: str) -> tuple[dict[str, int], tuple[int, int] | None]:
    """The opening's table: file -> lines, and its total row's (files, lines)."""
    section = next((body for heading, body in sections(text) if heading == DEFAULT_RUN), "")
    rows = {m[1]: int(m[2]) for m in re.finditer(r"^\| ([\w/]+\.py) \| (\d+) \|$", section, flags=re.M)}
    total = re.search(r"^\| total \((\d+) files\) \| ([\d,]+) \|$", section, flags=re.M)
    return rows, (int(total[1]), int(total[2].replace(",", ""))) if total else None


def default_run_problems(text: str, root: Path = REPO) -> list[str]:
    """The opening's table adds up, and names files of the repository."""
    rows, total = default_run_rows(text)
    problems = [f"{DEFAULT_RUN}: `{path}`: no such file" for path in rows if not (root / path).is_file()]
    if not rows or total is None:
        return problems + [f"{DEFAULT_RUN}: no table of `| file.py | lines |` rows and `| total (K files) | N |`"]
    if total != (len(rows), sum(rows.values())):
        problems.append(f"{DEFAULT_RUN}: the total row says {total[0]} files, {total[1]} lines; "
                        f"the rows add up to {len(rows)} files, {sum(rows.values())} lines")
    return problems


def problems_of(text: str, code: Code) -> list[str]:
    found = [p for span in named(text) if (p := name_problem(span, code))]
    found += file_problems(text, code) + map_problems(text, code) + output_problems(text, code) + link_problems(text)
    found += map_order_problems(text, code.root) + skeleton_problems(text, code.root) + cut_problems(text)
    found += unplaced_names(text, code) + default_run_problems(text, code.root)
    for heading, section in sections(text):  # the opening's command is the measured run: it need only parse
        found += [p for words in commands(section) for p in command_problems(words, laptop=heading != DEFAULT_RUN)]
    return found
