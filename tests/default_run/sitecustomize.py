"""What a real job runs of the project, recorded in every Python process of it: put this folder
first on the job's PYTHONPATH (Python imports `sitecustomize` at start-up, in torchrun's agent and
workers, mp.spawn's children, fork servers and what they fork) and name a folder in
DEFAULT_RUN_TRACE. The project is the files under DEFAULT_RUN_ROOT (default: this folder's
grandparent), less its tests/ and any virtual environment in it.

One profile function (sys.setprofile, threading.setprofile) appends a JSON line to
DEFAULT_RUN_TRACE/PID.jsonl, at once (a forked loader worker leaves by os._exit, with no atexit),
for:
  - each project code object's first call in the process: {"type": "first_call", "file", "line"
    (co_firstlineno), "name"}; modules (`<module>`) and class bodies included;
  - each torch.distributed collective called while a project frame is on the stack (the outermost
    one only: all_gather_object's own all_gather is not another): {"type": "collective", "name",
    "chain": [[file, function, line executed], ...] of the project frames, outermost first};
  - each start of a thread or process while a project frame is on the stack: {"type": "start",
    "kind" (thread, process, popen, os.fork, fork_exec), "id", "chain" as above, "via": the frames
    between the innermost project frame and the start, [[module, function, line], ...] outermost
    first, "target", "outlived": null}; for a thread or a multiprocessing process, a later
    {"type": "outlived", "id", "outlived": bool} says whether it was alive when that innermost
    project frame returned (for os.fork, a Popen, a fork_exec: never known).
tests/default_run/count.py reads them. Nothing here may break the run: any error is swallowed."""
import json
import os
import sys
import threading

_TRACE = os.environ.get("DEFAULT_RUN_TRACE")

COLLECTIVES = frozenset({
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"})
# torch.distributed's collectives that are C++ functions, seen as c_call events once torch.distributed is loaded.
C_COLLECTIVES = ("_broadcast_coalesced", "_verify_params_across_processes")

OTHER, PROJECT, COLLECTIVE, START, GENERATED = 0, 1, 2, 3, 4  # what a code object is


def _install(trace: str) -> None:
    root = os.path.realpath(os.environ.get("DEFAULT_RUN_ROOT")
                            or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    root_slash = root + os.sep
    tests_slash = os.path.join(root, "tests") + os.sep
    getpid, oswrite, dumps = os.getpid, os.write, json.dumps

    kinds: dict = {}  # code object: OTHER, PROJECT, COLLECTIVE, START or GENERATED
    start_kinds: dict = {}  # a START code object: "thread", "process" or "popen"
    relpaths: dict = {}  # co_filename: its path relative to the root, or None outside the project
    seen: set = set()  # the project code objects called in this process
    pending: dict = {}  # a starting project frame: [(start id, thread or process), ...]
    state = {"pid": None, "fd": None, "count": 0}
    c_builtins = {}  # c_call function: its kind ("os.fork", "fork_exec", or a collective's name)
    # The same functions, in four cells, for profile()'s identity checks (the cheapest test there is,
    # made on every call of a C function).
    c_fn0 = c_fn1 = c_fn2 = c_fn3 = object()
    torch_resolved = False

    def refresh_c_fns() -> None:
        nonlocal c_fn0, c_fn1, c_fn2, c_fn3
        fns = list(c_builtins)[:4]
        fns += [object()] * (4 - len(fns))
        c_fn0, c_fn1, c_fn2, c_fn3 = fns

    try:
        import _posixsubprocess  # subprocess's and multiprocessing's (spawnv_passfds) fork and exec
        c_builtins[_posixsubprocess.fork_exec] = "fork_exec"
    except Exception:
        pass
    if hasattr(os, "fork"):
        c_builtins[os.fork] = "os.fork"
    refresh_c_fns()

    def emit(record: dict) -> None:
        pid = getpid()
        if state["pid"] != pid:  # a forked child: a file of its own
            state["pid"], state["fd"] = pid, os.open(os.path.join(trace, f"{pid}.jsonl"),
                                                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        record["pid"] = pid
        try:
            record["thread"] = threading.current_thread().name
        except Exception:
            pass
        oswrite(state["fd"], (dumps(record) + "\n").encode())

    def relpath(filename: str):
        try:
            return relpaths[filename]
        except KeyError:
            pass
        rel = None
        if filename and not filename.startswith("<"):
            real = os.path.realpath(filename)
            if real.startswith(root_slash) and not real.startswith(tests_slash):
                rel = real[len(root_slash):]
                parts = rel.split(os.sep)
                if ("site-packages" in parts or "dist-packages" in parts or parts[0].startswith((".venv", "venv", "."))
                        or os.path.exists(os.path.join(root, parts[0], "pyvenv.cfg"))):
                    rel = None
        relpaths[filename] = rel
        return rel

    def resolve_torch() -> None:
        """torch.distributed's C++ collectives, once its import has defined them (it is in
        sys.modules from the start of its import on)."""
        nonlocal torch_resolved
        dist = sys.modules.get("torch.distributed")
        if dist is None:
            return
        fns = {getattr(dist, name, None): name for name in C_COLLECTIVES}
        if None in fns:
            return
        torch_resolved = True
        for fn, name in fns.items():
            if not hasattr(fn, "__code__"):  # a Python function: seen by its call event instead
                c_builtins[fn] = name
        refresh_c_fns()

    def classify(code) -> int:
        if not torch_resolved:
            resolve_torch()
        filename = code.co_filename
        kind = OTHER
        if relpath(filename) is not None:
            kind = PROJECT
        elif code.co_name in COLLECTIVES and filename.endswith(os.path.join("torch", "distributed", "distributed_c10d.py")):
            kind = COLLECTIVE
        else:
            qualname = getattr(code, "co_qualname", code.co_name)
            if code.co_name == "start" and qualname == "Thread.start" and filename.endswith("threading.py"):
                kind, start_kinds[code] = START, "thread"
            elif code.co_name == "start" and qualname == "BaseProcess.start" and filename.endswith(
                    os.path.join("multiprocessing", "process.py")):
                kind, start_kinds[code] = START, "process"
            elif code.co_name == "__init__" and qualname == "Popen.__init__" and filename.endswith("subprocess.py"):
                kind, start_kinds[code] = START, "popen"
            elif code.co_name == "__init__" and filename.startswith("<"):
                kind = GENERATED  # a dataclass's (or namedtuple's) __init__: whose class it makes is known at the call
        kinds[code] = kind
        return kind

    def kind_of(code) -> int:
        kind = kinds.get(code)
        return classify(code) if kind is None else kind

    def stack(frame, stop_at_start: bool):
        """The project frames from `frame` outwards, outermost first, and the other frames between
        `frame` and the innermost project one; None when the call is inside another collective (or
        start, `stop_at_start`), or when no project frame is on the stack."""
        chain, via, innermost = [], [], None
        while frame is not None:
            code = frame.f_code
            kind = kind_of(code)
            if kind == PROJECT:
                if innermost is None:
                    innermost = frame
                chain.append([relpaths[code.co_filename], code.co_name, frame.f_lineno])
            elif kind == COLLECTIVE or (stop_at_start and kind == START):
                return None
            elif innermost is None:
                via.append([frame.f_globals.get("__name__", code.co_filename), code.co_name, frame.f_lineno])
            frame = frame.f_back
        if innermost is None:
            return None
        chain.reverse()
        via.reverse()
        return chain, via, innermost

    def target_of(obj) -> str | None:
        target = getattr(obj, "_target", None)
        if target is None:
            return getattr(obj, "name", None) or type(obj).__qualname__
        return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"

    def started(kind: str, frame, obj, target: str | None = None) -> None:
        found = stack(frame, True)
        if found is None:
            return
        chain, via, innermost = found
        state["count"] += 1
        start_id = f"{getpid()}-{state['count']}"
        emit({"type": "start", "kind": kind, "id": start_id, "chain": chain, "via": via,
              "target": target_of(obj) if obj is not None else target, "outlived": None})
        if kind in ("thread", "process") and obj is not None:
            pending.setdefault(innermost, []).append((start_id, obj))

    def returned(frame) -> None:
        for start_id, obj in pending.pop(frame, ()):
            try:
                alive = bool(obj.is_alive())
            except Exception:
                alive = None
            emit({"type": "outlived", "id": start_id, "outlived": alive})

    def profile(frame, event, arg):
        try:
            if event == "c_call":  # the commonest event: one of four functions, or nothing to do
                if arg is c_fn0 or arg is c_fn1 or arg is c_fn2 or arg is c_fn3:
                    name = c_builtins[arg]
                    if name in ("os.fork", "fork_exec"):
                        started(name, frame, None, name)
                    else:
                        found = stack(frame, False)
                        if found is not None:
                            emit({"type": "collective", "name": name, "chain": found[0]})
            elif event == "call":
                code = frame.f_code
                kind = kinds.get(code)
                if kind is None:
                    kind = classify(code)
                if kind == OTHER:
                    return
                if kind == PROJECT:
                    if code not in seen:
                        seen.add(code)
                        emit({"type": "first_call", "file": relpaths[code.co_filename], "line": code.co_firstlineno,
                              "name": code.co_name})
                elif kind == COLLECTIVE:
                    found = stack(frame.f_back, False)
                    if found is not None:
                        emit({"type": "collective", "name": code.co_name, "chain": found[0]})
                elif kind == GENERATED:
                    if code not in seen:
                        seen.add(code)
                        made = type(frame.f_locals.get("self"))
                        rel = relpath(getattr(sys.modules.get(made.__module__), "__file__", None) or "")
                        if rel is not None:
                            emit({"type": "class_used", "file": rel, "name": made.__qualname__})
                else:  # START
                    kind, local = start_kinds[code], frame.f_locals
                    started(kind, frame.f_back, local.get("self") if kind != "popen" else None,
                            repr(local.get("args"))[:300] if kind == "popen" else None)
            elif event == "return":
                if pending and frame in pending:
                    returned(frame)
        except Exception:
            pass

    def after_fork_in_child() -> None:
        seen.clear()  # this process's own first calls
        pending.clear()  # its parent's frames never return here
        state["pid"] = state["fd"] = None

    os.makedirs(trace, exist_ok=True)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=after_fork_in_child)
    threading.setprofile(profile)
    sys.setprofile(profile)


if _TRACE:
    try:
        _install(_TRACE)
    except Exception:
        pass
