"""Layering: the library never depends on its services.

``libludic`` is usable without ``services/`` (a pip install of the library, a notebook);
the services import the library, never the other way. Checked on the source: every import
statement, and every string that names a ``services`` module (``importlib`` targets such as
``"services.actor.main:main"``), in every module of ``libludic``.
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
        p.write_text("import services.actor\nfrom services.common import x\n"
                     "T = 'services.learner.main:main'\nfrom .services import y\nS = 'the services'\n")
        assert [r.split(":", 1)[1] for r in service_references(p)] == [
            "import services.actor", "from services.common import ...",
            "module name 'services.learner.main:main'"]
    finally:
        LIB = saved


STREAM_COMMANDS = {
    "xadd", "xreadgroup", "xread", "xack", "xdel", "xclaim", "xautoclaim", "xlen", "xrange",
    "xrevrange", "xinfo_groups", "xinfo_consumers", "xinfo_stream", "xpending", "xpending_range",
    "xgroup_create", "xgroup_delconsumer", "xgroup_destroy", "xtrim", "eval", "evalsha",
    "register_script",
}


def stream_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.name}:{n.lineno}: .{n.func.attr}(" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in STREAM_COMMANDS
            # torch's nn.Module.eval() takes no argument; redis' eval always has a script
            and not (n.func.attr == "eval" and not n.args)]


def test_only_the_transport_package_talks_to_redis_streams() -> None:
    """Keys, codec, consumer (read, claim, commit, dead-letter), the accounting scripts and
    stream inspection live in libludic/transport/; every service and library module goes
    through its API."""
    root = LIB.parent
    files = [f for d in ("libludic", "services") for f in sorted((root / d).rglob("*.py"))
             if "transport" not in f.relative_to(root).parts]
    assert len(files) > 80
    calls = [c for f in files for c in stream_calls(f)]
    assert not calls, calls
    inside = [c for f in sorted((root / "libludic" / "transport").glob("*.py")) for c in stream_calls(f)]
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


def transport_private_names() -> set[str]:
    """``_x`` attributes the transport package's classes keep for themselves."""
    names: set[str] = set()
    for f in (LIB / "transport").glob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
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
                if (isinstance(n, ast.Attribute) and n.attr in private
                        and not (isinstance(n.value, ast.Name) and n.value.id == "self")):
                    found.append(f"{f.relative_to(root)}:{n.lineno}: {ast.unparse(n)}")
    assert not found, found
