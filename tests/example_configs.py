"""The shipped example run configs the unit tier builds, and the ones it leaves to the tier
that has what they need (each is checked there, never skipped everywhere)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: example -> where its config is built and checked instead
ELSEWHERE = {
    "verifiers": "verifiers 0.4.0 lives in its own venv: tests/adapters/test_verifiers_env.py "
    "builds this example's tasks there (make test runs it)",
    "openenv": "its env is an OpenEnv server: tests/adapters/test_openenv_env.py starts one "
    "and builds this example's tasks against it",
}


def run_configs() -> list[Path]:
    """examples/<name>/*.yaml (each a run config) of every example the project's venv builds
    by itself."""
    return sorted(p for p in ROOT.glob("examples/*/*.yaml") if p.parent.name not in ELSEWHERE)


def config_id(path: Path) -> str:
    """A test id: the example's name, then the config's when it is not grpo.yaml."""
    return path.parent.name if path.name == "grpo.yaml" else f"{path.parent.name}/{path.stem}"
