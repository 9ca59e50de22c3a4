"""docs/how-it-works.md cannot rot: what it names exists, and what it tells a reader to run parses.

The page's conventions, which this file enforces:
- a backticked span ending in `.py` is a file of the repository;
- `name()`, `ClassName`, `ClassName.member` and `module.NAME` are defined in the project's code
  (found with ast, not imported), and "`name()` in `path.py`" says in which file;
- a backticked `torch.` name exists in the installed PyTorch; plain lower-case words and
  ALL_CAPS names (environment variables) are not code names and are not checked;
- every ```bash line that starts a launcher (python X.py, torchrun ... X.py, python -m
  torch.distributed.launch ... X.py) parses with that launcher's own parser, and torchrun's
  options with torchrun's, all in this process: nothing trains;
- every line of an ```output block (what our launchers print) matches a string in the code;
  a block without an info string (PyTorch's log, a one-liner's print) is not checked; a block
  that leaves out lines a run prints between two it shows has a line `...` there (RUN_LINES);
- a ```text block (the map of calls) names functions and files by the same rules, and each
  indented call is made in the body of the call above it, after its previous sibling's (ast);
- each row of the skeleton's table names a call and "`function()` in `path.py`" that makes it;
- every project name on the page is given with its file at least once: "`name` in `path.py`",
  "`name` (same file)" after another name's file, or a line of the map;
- links to other pages lead to a file and heading that exist.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import importlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import PACKAGES, REPO

from multi_train_utils.config import get_args_parser

PAGE = REPO / "docs" / "how-it-works.md"
LAUNCHERS = {"train_single_gpu.py": "single", "train_multi_gpu_using_launch.py": "launch",
             "train_multi_gpu_using_spawn.py": "spawn"}
# How each program that starts launchers reads its own options, before the script's name.
STARTERS = {"torchrun": "torch.distributed.run", "torch.distributed.run": "torch.distributed.run",
            "torch.distributed.launch": "torch.distributed.launch"}
FILE_ENDINGS = (".py", ".pth", ".json", ".jsonl", ".csv", ".png", ".md", ".txt")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?")
# "`name()` in `path.py`", also "`Name` (in `path.py`)" and "`name()` (`path.py`)"
IN_FILE = re.compile(r"`([^`]+)`\s+(?:\(\s*)?(?:in\s+)?`([\w/.-]+\.py)`")
# "`name()` (same file)": the file named last before it
SAME_FILE = re.compile(r"`([^`]+)`\s+\(same\s+file\)")
# A line of the map: its indent, the call, and the files named after it.
MAP_CALL = re.compile(r"^( *)([A-Za-z_][\w.]*)\(\)")
CUT = "..."  # the line that stands for lines an output block leaves out
# The lines every training run prints on rank 0, in this order (an epoch line per epoch).
RUN_LINES = (r"process group: ", r"config: ", r"\w+: \d+ process\(es\) on ", r"\d+ images in \d+ classes",
             r"precision: ", r"training: epoch ", r"epoch \d+/\d+: ", r"report on ", r"time: start-up ", r"done: ")
# A redirection (2>&1, > out.log) is no argument of the command before it.
REDIRECTION = re.compile(r"(?<!\S)\d*(?:>>|>&|<&|>|<)\s*(?:&\d+|\S+)")
SHELL_WORDS = {"do", "then", "else", "time", "exec"}
MIN_LITERAL = 12  # characters a code string must fix for an output line to count as matching it


def source_files(root: Path) -> list[Path]:
    """The project's Python files, the tests included (a page may name a test)."""
    return [*root.glob("*.py"), *(path for package in PACKAGES for path in root.glob(f"{package}/*.py")),
            *root.glob("tests/*.py")]


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
    elif isinstance(node, ast.Assign):
        yield from (t.id for t in node.targets if isinstance(t, ast.Name))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        yield node.target.id


def _printable(tree: ast.Module) -> list[re.Pattern]:
    """Each string constant and f-string of a module as a pattern, its fields matching anything."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [(re.escape(v.value), len(v.value)) if isinstance(v, ast.Constant) else (".*?", 0)
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


def blocks(text: str, kind: str) -> list[str]:
    """The bodies of the page's fenced blocks whose info string is `kind`."""
    return re.findall(rf"^```{kind}\n(.*?)^```", text, flags=re.M | re.S)


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


def function_node(root: Path, path: str, name: str) -> ast.FunctionDef | ast.ClassDef | None:
    """The definition of `name` (`function`, `Class` or `Class.method`) at the top of `path`."""
    file = root / path
    if not file.is_file():
        return None
    body: list[ast.stmt] = ast.parse(file.read_text()).body
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
    tree = ast.parse((root / path).read_text())
    alias = {a.asname: a.name.rpartition(".")[2] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names if a.asname}
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


def commands(text: str) -> Iterator[list[str]]:
    """Each simple command of the page's bash blocks, as words: lines joined where they continue,
    split at ; & && | ||, with redirections and the variables set before a command left out."""
    for block in blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(REDIRECTION.sub(" ", line), posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words: list[str] = []
            for token in [*lexer, ";"]:
                if set(token) <= set(lexer.punctuation_chars):
                    while words and (words[0] in SHELL_WORDS or re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
                        words.pop(0)
                    if words:
                        yield words
                    words = []
                else:
                    words.append(token)


def launcher_call(words: list[str]) -> tuple[str | None, list[str], str, list[str]] | None:
    """(starter module, its options, script, the script's options) for a command that starts a
    launcher, or torchrun with anything; None for any other command."""
    program = Path(words[0]).name
    if program == "torchrun":
        starter, rest = STARTERS["torchrun"], words[1:]
    elif re.fullmatch(r"python[\d.]*", program):
        if words[1:2] == ["-m"]:
            if words[2] not in STARTERS:
                return None  # python -m pytest, python -m benchmarks
            starter, rest = STARTERS[words[2]], words[3:]
        else:
            starter, rest = None, words[1:]
    else:
        return None
    script_at = next((i for i, w in enumerate(rest) if Path(w).name in LAUNCHERS), None)
    if script_at is None and starter is not None:  # torchrun --no-python sh -c ...
        script_at = next((i for i, w in enumerate(rest) if not w.startswith("-") and not _is_value_of_option(rest, i)),
                         None)
    if script_at is None:
        return None  # python -c ..., python predict.py ...
    return starter, rest[:script_at], Path(rest[script_at]).name, rest[script_at + 1:]


def _is_value_of_option(words: list[str], i: int) -> bool:
    """Whether words[i] is the value of the option before it (`--nnodes 2`), not the program."""
    return i > 0 and words[i - 1].startswith("-") and "=" not in words[i - 1] and words[i - 1] not in (
        "--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "--module", "-m")


def parse_problem(parse: Callable[[list[str]], argparse.Namespace], argv: list[str],
                  what: str) -> tuple[argparse.Namespace | None, str | None]:
    """What `parse` makes of `argv`, or the last line of its complaint."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parse(argv), None
    except SystemExit:
        complaint = err.getvalue().strip().splitlines() or ["refused"]
        return None, f"{what}: {complaint[-1]}"


def command_problems(words: list[str]) -> list[str]:
    """Why a launcher command of the page would not start, as far as parsing can tell."""
    call = launcher_call(words)
    if call is None:
        return []
    starter, starter_options, script, options = call
    shown = " ".join(words)
    problems = []
    if starter is not None:  # torchrun's own options, or the legacy launcher's (its --use-env too)
        _, problem = parse_problem(importlib.import_module(starter).parse_args, [*starter_options, script],
                                   f"{shown}\n  {starter}")
        problems += [problem] if problem else []
    if script not in LAUNCHERS:
        return problems  # torchrun --no-python sh -c ...: only torchrun's options are ours to check
    parser = get_args_parser("how-it-works", launcher=LAUNCHERS[script])
    args, problem = parse_problem(parser.parse_args, options, f"{shown}\n  {script}")
    if problem:
        return problems + [problem]
    if not (REPO / args.data_path).is_dir():
        problems.append(f"{shown}\n  --data-path {args.data_path}: not a folder of this repository (the bundled sample?)")
    if args.device != "cpu":
        problems.append(f"{shown}\n  runs on a laptop's CPU only with --device cpu")
    return problems


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


def problems_of(text: str, code: Code) -> list[str]:
    found = [p for span in named(text) if (p := name_problem(span, code))]
    found += file_problems(text, code) + map_problems(text, code) + output_problems(text, code) + link_problems(text)
    found += map_order_problems(text, code.root) + skeleton_problems(text, code.root) + cut_problems(text)
    found += unplaced_names(text, code)
    found += [p for words in commands(text) for p in command_problems(words)]
    return found


@pytest.fixture(scope="module")
def code() -> Code:
    return Code()


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text()


def test_the_page_is_true_of_the_code(page, code):
    assert problems_of(page, code) == []


def test_the_page_names_enough_to_be_a_tour(page, code):
    functions = {s for s in named(page) if s.endswith("()") and not s.startswith("torch.") and
                 name_problem(s, code) is None}
    launches = [w for w in commands(page) if (call := launcher_call(w)) and call[2] in LAUNCHERS]
    assert len(functions) >= 20, sorted(functions)
    assert len(launches) >= 8, launches
    assert len(IN_FILE.findall(prose(page))) >= 15  # "`name()` in `file.py`" is how the page says where
    for section in re.split(r"^## (?=\d+\. )", page, flags=re.M)[1:]:
        assert blocks(section, "bash"), f"the stop '{section.splitlines()[0]}' ends without a command to run"


def reading_cost(text: str, root: Path = REPO) -> tuple[int, int]:
    """What following one run costs a reader: the page's lines, and the lines of the functions
    that the skeleton and the map's first launcher (torchrun's, down to `run()`'s calls) name."""
    lines: set[tuple[str, int]] = set()
    wanted = [(fn.removesuffix("()"), path) for _, fn, path in skeleton_rows(text)]
    for i, (indent, name, paths) in enumerate(map_lines(text)):
        if indent == 0 and i > 0:
            break
        wanted += [(name, paths[0])] if paths else []
    for name, path in wanted:
        if (node := function_node(root, path, name)) is not None:
            lines |= {(path, n) for n in range(node.lineno, node.end_lineno + 1)}
    return len(text.splitlines()), len(lines)


def test_the_page_states_its_reading_cost(page):
    """The opening's figures, within 10%: the page's lines and the code it sends a reader to."""
    stated = re.search(r"this page's ([\d,]+) lines.*?([\d,]+) lines of code", " ".join(page.split()))
    assert stated, "the opening says what following one run costs: this page's N lines ... M lines of code"
    for said, counted in zip((int(n.replace(",", "")) for n in stated.groups()), reading_cost(page)):
        assert abs(said - counted) <= counted / 10, (said, counted)


def test_the_nine_stops_come_first_in_at_most_250_lines(page):
    """The run's stops open the page, 1 to 9 in order, and take at most 250 lines; the reference
    (skeleton, rule, meeting points, map) follows them."""
    headings = [(n, line) for n, line in enumerate(page.splitlines()) if line.startswith("## ")]
    stops = [(n, line) for n, line in headings if re.match(r"## \d\. ", line)]
    assert [line[3] for _, line in stops] == [str(i) for i in range(1, 10)]
    assert headings[:9] == stops, "the stops come before every other section"
    assert headings[9][0] - stops[0][0] <= 250, headings[9][0] - stops[0][0]


def test_readme_links_the_page_on_its_first_screen():
    first_screen = REPO.joinpath("README.md").read_text().split("\n## ", 1)[0]
    assert "(docs/how-it-works.md)" in first_screen
    skeleton = re.search(r"\(docs/how-it-works\.md#([\w-]+)\)", first_screen)
    assert skeleton and skeleton[1] in {_slug(h) for h in re.findall(r"^#+ (.+)$", PAGE.read_text(), flags=re.M)}
    assert "skeleton" in skeleton[1]


@pytest.mark.parametrize("change, complaint", [
    # A function renamed in the code but not on the page, and the other ways a page goes stale.
    (("`env_ranks()`", "`environment_ranks()`"), "`environment_ranks()`: defined nowhere"),
    (("`ShardSampler`", "`ShardedSampler`"), "`ShardedSampler`: defined nowhere"),
    (("`RunData.loaders()`", "`RunData.train_loaders()`"), "`RunData.train_loaders()`: no such member"),
    (("`train_eval_utils.CHECK_EVERY`", "`train_eval_utils.CHECK_EVERY_STEPS`"), "not defined at the top"),
    (("`torch.optim.SGD`", "`torch.optim.SGDM`"), "not in torch"),
    (("`outputs/report.py`", "`multi_train_utils/reports.py`"), "no such file"),
    (("`save_atomic()` in `multi_train_utils/checkpoint.py` calls", "`save_atomic()` in `outputs/run_folder.py` calls"),
     "`save_atomic()` is not defined in `outputs/run_folder.py`"),
    (("build_datasets()              multi_train_utils/loaders.py", "build_datasets()              multi_train_utils/config.py"),
     "map: build_datasets() is in none of multi_train_utils/config.py"),
    (("--img-size 32 --no-plots --output-dir runs/tour\n", "--img-sise 32 --no-plots --output-dir runs/tour\n"),
     "unrecognized arguments: --img-sise"),
    (("--world-size 2 --dist-url", "--world-sizes 2 --dist-url"), "unrecognized arguments: --world-sizes"),
    (("data/flower_photos_sample --epochs 1 --img-size 32 --no-plots --lr",
      "data/flower_photos --epochs 1 --img-size 32 --no-plots --lr"), "--data-path data/flower_photos: not a folder"),
    (("spawn.py --world-size 2 --device cpu", "spawn.py --world-size 2 --device cuda"), "only with --device cpu"),
    (("torchrun --nproc_per_node=2 --no-python", "torchrun --nproc-per-nodes=2 --no-python"), "torch.distributed.run"),
    (("process group: backend=gloo, world_size=2, threads",
      "process group joined: backend=gloo, world_size=2, threads"), "printed by nothing in the code"),
    (("(multi-node.md#slurm)", "(multi-node.md#slurm-jobs)"), "no such heading"),
    # The map in another order than the code's: the launcher joins the group before it trains,
    (("  job_store()                     multi_train_utils/distributed_utils.py  where the processes meet\n",
      "  train()                         train_multi_gpu_using_launch.py         the run, in every process: read it\n"
      "  job_store()                     multi_train_utils/distributed_utils.py  where the processes meet\n"),
     "map: main() does not call job_store() after train()"),
    # and wraps the model in DDP before the optimizer is built, not after;
    (("    torch.nn.parallel.DistributedDataParallel()                           the wrap\n"
      "    build_optimizer()             multi_train_utils/train_eval_utils.py   after the wrap\n",
      "    build_optimizer()             multi_train_utils/train_eval_utils.py   after the wrap\n"
      "    torch.nn.parallel.DistributedDataParallel()                           the wrap\n"),
     "map: train() does not call torch.nn.parallel.DistributedDataParallel() after build_optimizer()"),
    # a call said to be made where it is not (the optimizer's step is train_one_epoch's, not evaluate_epoch's).
    (("      all_reduce_sum()            multi_train_utils/distributed_utils.py  one all-reduce\n",
      "      all_reduce_sum()            multi_train_utils/distributed_utils.py  one all-reduce\n"
      "      torch.amp.GradScaler.step()\n"), "map: evaluate_epoch() does not call torch.amp.GradScaler.step()"),
    # A skeleton call put in a function that does not make it.
    (("| `torch.nn.parallel.DistributedDataParallel.no_sync()` | `train_one_epoch()`",
      "| `torch.nn.parallel.DistributedDataParallel.no_sync()` | `evaluate_epoch()`"),
     "skeleton: `torch.nn.parallel.DistributedDataParallel.no_sync()` is not called in `evaluate_epoch()`"),
    (("| `torch.utils.data.DistributedSampler.set_epoch()` | `train()` in `train_multi_gpu_using_launch.py`",
      "| `torch.utils.data.DistributedSampler.set_epoch()` | `train_one_epoch()` in `multi_train_utils/train_eval_utils.py`"),
     "skeleton: `torch.utils.data.DistributedSampler.set_epoch()` is not called in `train_one_epoch()`"),
    # An output block that drops the config: line without saying so.
    (("threads per process=1\n...\nlaunch:", "threads per process=1\nlaunch:"),
     "output block cut without a `...` line between: process group"),
    # A name given without its file, and a "(same file)" that names the wrong one.
    (("`image_seed()` in `my_dataset.py`", "`image_seed()`"), "`image_seed` is never given with its file"),
    (("`join_processes()` (same file)", "`join_processes()` in `multi_train_utils/loaders.py`"),
     "`join_processes()` is not defined in `multi_train_utils/loaders.py`"),
])
def test_a_stale_page_is_caught(page, code, change, complaint):
    old, new = change
    assert old in page, f"the page no longer holds {old!r}: pick another example"
    problems = problems_of(page.replace(old, new, 1), code)
    assert any(complaint in p for p in problems), problems


def test_renaming_a_function_in_the_code_fails_the_page(page, tmp_path):
    """The real page against a copy of the code in which env_ranks() has a new name."""
    for path in source_files(REPO):
        copy = tmp_path / path.relative_to(REPO)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text().replace("def env_ranks(", "def ranks_from_environment("))
    problems = problems_of(page, Code(tmp_path))
    assert "`env_ranks()`: defined nowhere in the project" in problems, problems
    assert "map: env_ranks() is in none of multi_train_utils/distributed_utils.py" in problems, problems


def test_commands_are_split_as_a_shell_splits_them():
    text = ("```bash\n"
            "for r in 0 1; do RANK=$r python train_single_gpu.py --epochs 1 & done; wait\n"
            "X=1 torchrun --nnodes 1 --nproc_per_node=2 train_multi_gpu_using_launch.py \\\n"
            "    --epochs 2 2>&1 | grep -E 'a|b'  # a comment\n"
            "python -m torch.distributed.launch --nproc_per_node=2 --use_env train_multi_gpu_using_launch.py --sync-bn\n"
            "```\n")
    calls = [launcher_call(w) for w in commands(text)]
    assert [c for c in calls if c] == [
        (None, [], "train_single_gpu.py", ["--epochs", "1"]),
        ("torch.distributed.run", ["--nnodes", "1", "--nproc_per_node=2"], "train_multi_gpu_using_launch.py",
         ["--epochs", "2"]),
        ("torch.distributed.launch", ["--nproc_per_node=2", "--use_env"], "train_multi_gpu_using_launch.py",
         ["--sync-bn"]),
    ]


def test_the_readmes_launcher_commands_parse():
    """The README's commands (the quick start first) are not a tour's, run on a laptop: they
    may name GPUs and the full dataset. Their options must still exist."""
    readme = REPO.joinpath("README.md").read_text()
    launches = [(w, call) for w in commands(readme) if (call := launcher_call(w)) and call[2] in LAUNCHERS]
    assert len(launches) >= 4, launches
    for words, (_, _, script, options) in launches:
        parser = get_args_parser("readme", launcher=LAUNCHERS[script])
        _, problem = parse_problem(parser.parse_args, options, " ".join(words))
        assert problem is None, problem
    quick_start = launches[0][1][3]
    assert "data/flower_photos_quick" in quick_start and (REPO / "data" / "flower_photos_quick").is_dir()
