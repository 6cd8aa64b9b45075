"""Layering: the library never depends on its services (issue #14).

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
