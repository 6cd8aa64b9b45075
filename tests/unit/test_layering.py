"""Layering: the library never depends on its services, its imports run down its layers
only, no two modules (of the library or of the services) import each other, however lazily,
and an import inside a function says why it is not at the top.

``libludic`` is usable without ``services/`` (a pip install of the library, a notebook);
the services import the library, never the other way. Checked on the source: every import
statement, and every string that names a ``services`` module (``importlib`` targets such as
``"services.actor.main:main"``), in every module of ``libludic``.

Inside ``libludic``, :data:`LAYERS` orders its parts bottom-up; the wire-level data (rollouts,
rollout requests, SAW items) sits at the bottom, so the codec, the engine and the evaluator
import it without importing what produces or consumes it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "libludic"
MODULE_STRING = re.compile(r"services(\.\w+)+(:\w+)?")


def service_references(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "services"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "services":
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if MODULE_STRING.fullmatch(node.value):
                found.append(f"module name {node.value!r}")
    return [f"{path.relative_to(LIB.parent)}:{ref}" for ref in found]


def test_libludic_imports_nothing_from_services() -> None:
    files = sorted(LIB.rglob("*.py"))
    assert len(files) > 50  # the walk found the package
    refs = [r for f in files for r in service_references(f)]
    assert not refs, refs


def test_the_check_sees_each_kind_of_reference(tmp_path: Path) -> None:
    global LIB
    saved, LIB = LIB, tmp_path
    try:
        p = tmp_path / "m.py"
        p.write_text(
            "import services.actor\nfrom services.common import x\n"
            "T = 'services.learner.main:main'\nfrom .services import y\nS = 'the services'\n"
        )
        assert [r.split(":", 1)[1] for r in service_references(p)] == [
            "import services.actor",
            "from services.common import ...",
            "module name 'services.learner.main:main'",
        ]
    finally:
        LIB = saved


# bottom-up: a part imports parts of lower layers only (never its own layer's other parts)
LAYERS: tuple[tuple[str, ...], ...] = (
    # the one backoff formula, the one kind resolver, which variables carry secrets
    # (import nothing)
    ("retry", "plugins", "secret_env"),
    (
        "types",
        "saw",
        "staleness",
        "fingerprint",
        "parsers",
        "models",
        "distributed",
    ),  # data, pure helpers
    ("inference", "context", "envs"),
    ("requests", "agents"),
    ("interaction", "eval", "scoring"),
    ("rollout",),
    ("transport", "registry"),
    ("tasks",),
    # seqlen: whether a task's items fit the learner's max_seq_len (it builds tasks)
    ("training", "seqlen"),
    ("sft",),  # warm starts: the training step checked by greedy episodes of an env
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(LIB.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_imports(path: Path, modules: set[str]) -> set[str]:
    """The ``modules`` (of ``libludic``, and of ``services`` for the cycle check) ``path``
    imports anywhere in it: import statements at any depth (inside functions too) and lazy
    re-exports (module names held in a dict or passed to ``import_module``)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out |= {
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            }
        elif isinstance(node, ast.Dict) or (
            isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
        ):
            values = node.values if isinstance(node, ast.Dict) else node.args
            out |= {
                v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)
            }
    return {m for m in out if m in modules and m != me}


def import_graph(packages: tuple[str, ...] = ("libludic",)) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (``packages`` beside ``libludic``)."""
    files = {module_name(f): f for p in packages for f in (LIB.parent / p).rglob("*.py")}
    return {m: library_imports(f, set(files)) for m, f in files.items()}


def part_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def layer_of(module: str) -> int:
    part = part_of(module)
    for i, parts in enumerate(LAYERS):
        if part in parts:
            return i
    raise AssertionError(f"{module}: part {part!r} is in no layer of LAYERS; place it")


def test_imports_run_down_the_layers_only() -> None:
    graph = import_graph()
    assert len(graph) > 50
    wrong = [
        f"{m} -> {d} (layer {layer_of(m)} -> {layer_of(d)})"
        for m, deps in sorted(graph.items())
        for d in sorted(deps)
        if part_of(m) != part_of(d) and layer_of(d) >= layer_of(m)
    ]
    assert not wrong, wrong


def folded(graph: dict[str, set[str]], depth: int = 3) -> dict[str, set[str]]:
    """``graph`` with every package below ``depth`` dotted names folded into one node
    (``libludic.training.batching.pipeline`` -> ``libludic.training.batching``)."""
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        node = ".".join(m.split(".")[:depth])
        out.setdefault(node, set()).update(".".join(d.split(".")[:depth]) for d in deps)
    return {m: deps - {m} for m, deps in out.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other_even_lazily() -> None:
    """Neither in the library nor in the services (whose modules also import the library's):
    a lazy import that closes a cycle hides a type in the wrong room."""
    graph = import_graph(("libludic", "services"))
    assert sum(m.startswith("services.") for m in graph) > 40  # the walk found the services
    assert not cycles(graph), cycles(graph)


def test_a_subpackage_is_one_level_of_its_part() -> None:
    """A subpackage (``training/batching``, ``envs/code_exec``) folded into one node closes
    no cycle with its siblings: it holds modules of one level, not a low helper that its
    part's lower modules import beside a high one that imports them."""
    graph = folded(import_graph())
    assert "libludic.training.batching" in graph
    assert not cycles(graph), cycles(graph)


def test_the_checks_see_lazy_imports_cycles_and_layers(tmp_path: Path) -> None:
    global LIB
    saved, LIB = LIB, tmp_path / "libludic"
    try:
        (LIB / "training").mkdir(parents=True)
        (LIB / "types.py").write_text("def f():\n    from libludic.training import trainer\n")
        (LIB / "training" / "__init__.py").write_text("E = {'T': 'libludic.training.trainer'}\n")
        (LIB / "training" / "trainer.py").write_text(
            "from ..types import f\nfrom libludic import types\n"
        )
        graph = import_graph()
        assert graph == {
            "libludic.types": {"libludic.training.trainer"},
            "libludic.training": {"libludic.training.trainer"},
            "libludic.training.trainer": {"libludic.types"},
        }
        assert cycles(graph) == [["libludic.training.trainer", "libludic.types"]]
        assert layer_of("libludic.types") == 1 and layer_of("libludic.training.trainer") == 8
        # a services module that imports another only inside a function still closes a cycle
        (LIB.parent / "services" / "common").mkdir(parents=True)
        (LIB.parent / "services" / "a.py").write_text(
            "from services.common import b\nfrom libludic import types\n"
        )
        (LIB.parent / "services" / "common" / "b.py").write_text(
            "def f():\n    import services.a\n"
        )
        both = import_graph(("libludic", "services"))
        assert both["services.a"] == {"services.common.b", "libludic.types"}
        assert ["services.a", "services.common.b"] in cycles(both)
    finally:
        LIB = saved


STREAM_COMMANDS = {
    "xadd",
    "xreadgroup",
    "xread",
    "xack",
    "xdel",
    "xclaim",
    "xautoclaim",
    "xlen",
    "xrange",
    "xrevrange",
    "xinfo_groups",
    "xinfo_consumers",
    "xinfo_stream",
    "xpending",
    "xpending_range",
    "xgroup_create",
    "xgroup_delconsumer",
    "xgroup_destroy",
    "xtrim",
    "eval",
    "evalsha",
    "register_script",
}


def stream_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.name}:{n.lineno}: .{n.func.attr}("
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in STREAM_COMMANDS
        # torch's nn.Module.eval() takes no argument; redis' eval always has a script
        and not (n.func.attr == "eval" and not n.args)
    ]


def test_only_the_transport_package_talks_to_redis_streams() -> None:
    """Keys, codec, consumer (read, claim, commit, dead-letter), the accounting scripts and
    stream inspection live in libludic/transport/; every service and library module goes
    through its API."""
    root = LIB.parent
    files = [
        f
        for d in ("libludic", "services")
        for f in sorted((root / d).rglob("*.py"))
        if "transport" not in f.relative_to(root).parts
    ]
    assert len(files) > 80
    calls = [c for f in files for c in stream_calls(f)]
    assert not calls, calls
    inside = [
        c for f in sorted((root / "libludic" / "transport").glob("*.py")) for c in stream_calls(f)
    ]
    assert len(inside) > 10  # the scan sees the calls where they are


SERVICES = ("actor", "credit", "eval", "feeder", "inference", "learner")


def calls(tree: ast.AST) -> set[str]:
    """Dotted names of every call in ``tree`` (``asyncio.run``, ``service_main``, ...)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            out.add(ast.unparse(node.func))
    return out


def test_every_service_main_is_wiring_on_the_shared_skeleton() -> None:
    """Each long-running service's ``main.py`` hands its lifecycle to ``service_main`` (settings,
    logging, signals, exit codes) and stays wiring only: no event loop or signal handler of its
    own, under 200 lines."""
    root = LIB.parent / "services"
    problems = []
    for name in SERVICES:
        path = root / name / "main.py"
        source = path.read_text()
        found = calls(ast.parse(source))
        if "service_main" not in found:
            problems.append(f"{name}: main() does not call service_main")
        own = found & {"asyncio.run", "signal.signal", "loop.add_signal_handler"}
        if own:
            problems.append(f"{name}: runs its own lifecycle ({sorted(own)})")
        if len(source.splitlines()) > 200:
            problems.append(f"{name}: main.py has {len(source.splitlines())} lines (> 200)")
    assert not problems, problems


def test_every_service_has_one_layout() -> None:
    """Every service directory holds the same three rooms: ``main.py`` (the process: settings
    in, ``run()`` wiring Redis/HTTP to the worker, exit codes), ``settings.py`` (its settings
    dataclass, the one thing ``ludic <service> --help`` reads) and ``worker.py`` (what the
    service does); anything else is a helper module of that worker. The settings class lives
    in settings.py and nowhere else."""
    root = LIB.parent / "services"
    problems = []
    for name in (*SERVICES, "launcher"):
        d = root / name
        for room in ("main.py", "settings.py", "worker.py"):
            if not (d / room).is_file():
                problems.append(f"{name}: no {room}")
        for f in d.glob("*.py"):
            if f.name == "settings.py":
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Settings"):
                    problems.append(f"{name}: {f.name} defines {node.name} (settings.py does)")
    assert not problems, problems


def transport_private_names() -> set[str]:
    """``_x`` attributes the transport package's classes keep for themselves."""
    names: set[str] = set()
    for f in (LIB / "transport").glob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
            ):
                if n.attr.startswith("_") and not n.attr.startswith("__"):
                    names.add(n.attr)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                if n.target.id.startswith("_") and not n.target.id.startswith("__"):
                    names.add(n.target.id)
    return names


def test_nothing_outside_the_transport_package_reaches_into_its_objects() -> None:
    """``consumer._cursor`` and the like: private state of StreamConsumer, Lease, ... is read
    and written only by the transport package; outside it, ``self._x`` is the
    caller's own attribute and is not flagged."""
    private = transport_private_names()
    assert {"_cursor", "_commit"} <= private  # the scan sees StreamConsumer's own state
    root = LIB.parent
    found = []
    for d in ("libludic", "services"):
        for f in sorted((root / d).rglob("*.py")):
            if "transport" in f.relative_to(root).parts:
                continue
            for n in ast.walk(ast.parse(f.read_text())):
                if (
                    isinstance(n, ast.Attribute)
                    and n.attr in private
                    and not (isinstance(n.value, ast.Name) and n.value.id == "self")
                ):
                    found.append(f"{f.relative_to(root)}:{n.lineno}: {ast.unparse(n)}")
    assert not found, found


SERVICES_DIR = LIB.parent / "services"


# the one module that reads other services' settings classes (and nothing else of them):
# the launcher resolves the knobs it acts on exactly as the services it starts resolve them
READS_SETTINGS_OF_OTHERS = "launcher/resolved.py"


def test_no_service_imports_another() -> None:
    """Each service imports the library, services.common and itself only (the launcher
    starts the others as processes, by module name, never by import; its
    :data:`READS_SETTINGS_OF_OTHERS` module imports their ``settings`` modules only)."""
    found = []
    for path in sorted(SERVICES_DIR.rglob("*.py")):
        own = path.relative_to(SERVICES_DIR).parts[0]
        if own in ("common", "cli.py", "__init__.py"):
            continue
        settings_only = path.relative_to(SERVICES_DIR).as_posix() == READS_SETTINGS_OF_OTHERS
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "services" and len(parts) > 1 and parts[1] not in ("common", own):
                    if settings_only and parts[2:] == ["settings"]:
                        continue
                    found.append(f"{path.relative_to(SERVICES_DIR.parent)}: imports {name}")
    assert len(list(SERVICES_DIR.glob("*/main.py"))) >= 6  # the walk found the services
    assert not found, found


def _statement_lists(node: ast.AST) -> list[list[ast.stmt]]:
    """Every statement list under ``node`` (bodies, else and finally blocks, handlers)."""
    out = []
    for n in ast.walk(node):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(n, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                out.append(block)
    return out


def lazy_imports_without_a_reason(path: Path) -> list[str]:
    """Imports inside functions whose group (consecutive import statements) has no comment
    on any of its lines or on the line above it."""
    lines = path.read_text().splitlines()
    found = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for block in _statement_lists(fn):
            run: list[ast.stmt] = []
            for stmt in [*block, None]:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    run.append(stmt)
                    continue
                if run:
                    start, end = run[0].lineno - 2, run[-1].end_lineno or run[-1].lineno
                    if not any("#" in line for line in lines[max(start, 0) : end]):
                        found.append(f"{path.relative_to(LIB.parent)}:{run[0].lineno}")
                run = []
    return sorted(set(found))


def test_every_lazy_import_says_why() -> None:
    """An import inside a function says why it is not at the top, in a comment on its line
    or the line above (an optional dependency; a heavy one an entry point must not load,
    e.g. torch for ``--help``; vLLM's modules in a plugin vLLM loads everywhere). Without a
    reason it belongs at the top, where a cycle it would close shows at once."""
    files = [f for d in ("libludic", "services") for f in sorted((LIB.parent / d).rglob("*.py"))]
    found = [hit for f in files for hit in lazy_imports_without_a_reason(f)]
    assert not found, found


def test_the_lazy_import_check_sees_a_group_without_a_reason(tmp_path: Path) -> None:
    global LIB
    saved, LIB = LIB, tmp_path / "libludic"
    try:
        LIB.mkdir()
        p = LIB / "m.py"
        p.write_text(
            "def f():\n    import os\n    import sys\n\n"
            "def g():\n    # optional dependency\n    import yaml\n    import json\n\n"
            "def h():\n    try:\n        import datasets  # optional\n    except ImportError:\n"
            "        import csv\n"
        )
        assert lazy_imports_without_a_reason(p) == ["libludic/m.py:14", "libludic/m.py:2"]
    finally:
        LIB = saved


def test_folding_joins_a_subpackage_into_one_node() -> None:
    graph = {
        "libludic.training.batching.pipeline": {"libludic.training.ranks"},
        "libludic.training.ranks": {"libludic.training.batching.saw"},
        "libludic.training.batching.saw": set(),
    }
    assert cycles(graph) == []
    assert folded(graph) == {
        "libludic.training.batching": {"libludic.training.ranks"},
        "libludic.training.ranks": {"libludic.training.batching"},
    }
    assert cycles(folded(graph)) == [["libludic.training.batching", "libludic.training.ranks"]]
