"""The soak (scripts/soak.py) at reduced length: 4 actors under `ludic up` for 2 minutes;
stream lengths, Redis memory and every process's resident set stay bounded, the accounting
identity holds at every sample, and SIGTERM leaves nothing running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_stays_bounded(tmp_path, tiny_model_dir):
    argv = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes", "2"]
    argv += ["--interval", "4", "--model", str(tiny_model_dir), "--out", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("SOAK ok"), proc.stdout[-2000:]
    data = json.loads((tmp_path / "soak.json").read_text())
    figures = {row["figure"] for row in data["rows"]}
    for name in ("requests", "rollouts", "saw", "deadletter"):
        assert f"stream/{name}" in figures
    assert "redis/keys_other" in figures
    services = {f.split("/")[1] for f in figures if f.startswith("rss/")}
    assert {
        "actor",
        "credit",
        "feeder",
        "learner",
        "inference",
        "redis-server",
        "launcher",
    } <= services
    actors = {f for f in figures if f.startswith("rss/actor/")}
    assert len(actors) == 4, actors
    samples = data["samples"]
    assert samples[-1]["step"] > samples[0]["step"] > 0  # trained throughout
    assert all(s["accounting"]["consistent"] for s in samples)
