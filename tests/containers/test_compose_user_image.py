"""A user's own package in containers (README "Bring your own environment"), on a real engine.

The user's image is built FROM the project's (examples/custom_env/Dockerfile, through the
compose override examples/custom_env/deploy/compose.yaml); then

* fail fast: with a misspelt env kind in the run config, the feeder, actor and eval
  containers exit 2 within seconds, each naming the key, the value and the choices;
* the package trains: the stack with the override (its warm start skipped, 3 learner steps)
  runs the package's env, tool and reward function from their entry points; the learner
  reaches its step count and exits 0, the actors committed requests of the task and
  dead-lettered none.

A separate compose project (``ludic-guess``), started after the demo stack of
test_compose_e2e.py is down. Figures go to $LUDIC_CONTAINERS_REPORT's sibling
``*-user-image.json``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.containers

ROOT = Path(__file__).resolve().parents[2]
OVERRIDE = ROOT / "examples" / "custom_env" / "deploy" / "compose.yaml"
PROJECT = "ludic-guess"
STEPS = 3
REPORT: dict[str, Any] = {}


def compose(*args: str, files: tuple[Path, ...] = (), check: bool = True, timeout: float = 900,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    argv = [
        "docker",
        "compose",
        "-p",
        PROJECT,
        "-f",
        str(ROOT / "compose.yaml"),
        "-f",
        str(OVERRIDE),
    ]
    for f in files:
        argv += ["-f", str(f)]
    p = subprocess.run(
        [*argv, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "MODEL_NAME": "guess-grpo", "SFT_STEPS": "0",
             "NUM_STEPS": str(STEPS), "ACTORS": "1", **(env or {})},
    )  # fmt: skip
    if check and p.returncode != 0:
        raise AssertionError(
            f"compose {' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    return p


@pytest.fixture(scope="module")
def built() -> None:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers `docker info`: run `sudo scripts/docker-host.sh`")
    if not (ROOT / ".env").exists():
        pytest.fail(".env is missing: `make compose-env`")
    t0 = time.monotonic()
    compose("build", "feeder")  # one image for every service of the override
    REPORT["user_image_build_s"] = round(time.monotonic() - t0, 1)
    yield
    compose("down", "-v", "--remove-orphans", check=False)
    out = Path(os.environ.get("LUDIC_CONTAINERS_REPORT", "/tmp/ludic-containers-report.json"))
    out.with_name(out.stem + "-user-image.json").write_text(json.dumps(REPORT, indent=1))


@pytest.mark.parametrize("service", ["feeder", "actor", "eval"])
def test_a_misspelt_kind_stops_the_container_at_start_up(built, service, tmp_path):
    cfg = yaml.safe_load((ROOT / "examples/custom_env/grpo.yaml").read_text())
    cfg["feeder"]["tasks"][0]["env"]["kind"] = "gues"
    for eval_set in cfg["up"]["eval_sets"]:
        eval_set["env"]["kind"] = "gues"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    bad.chmod(0o644)
    third = tmp_path / "bad-config.yaml"
    third.write_text(yaml.safe_dump({"configs": {"ludic-config": {"file": str(bad)}}}))
    t0 = time.monotonic()
    p = compose("run", "--rm", "--no-deps", service, files=(third,), check=False, timeout=300)
    took = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert re.search(
        r"env.kind='gues' is unknown; registered: \[.*guess.*\]; did you mean 'guess'\?", out
    ), out[-3000:]
    REPORT[f"fail_fast_{service}_s"] = round(took, 1)
    assert took < 60, f"{service} took {took:.0f} s to refuse the config"


def test_the_users_package_trains_in_containers(built):
    compose("down", "-v", "--remove-orphans", check=False)
    t0 = time.monotonic()
    compose("up", "-d", "redis", "inference", "actor", "credit", "learner", "feeder", timeout=1800)
    deadline = time.monotonic() + 1200
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        ids = compose("ps", "-a", "-q", "learner").stdout.split()
        if ids:
            state = json.loads(subprocess.run(
                ["docker", "inspect", "-f", "{{json .State}}", ids[0]], capture_output=True, text=True
            ).stdout)  # fmt: skip
            if state.get("Status") == "exited" and state.get("ExitCode") == 0:
                break
        time.sleep(5)
    REPORT["train_s"] = round(time.monotonic() - t0, 1)
    logs = compose("logs", "--no-color", "learner", "actor", "feeder", check=False).stdout
    assert state.get("ExitCode") == 0 and state.get("Status") == "exited", logs[-6000:]
    assert re.search(rf"weights of step {STEPS}\b", logs), logs[-4000:]
    # the actor ran the package's task and dead-lettered nothing (its metrics, read inside)
    probe = (
        "import urllib.request as u; t=u.urlopen('http://127.0.0.1:9101/metrics').read().decode();"
        "print('\\n'.join(l for l in t.splitlines() if l.startswith('ludic_actor_task_requests_total')))"
    )
    m = compose("exec", "-T", "actor", "python", "-c", probe).stdout
    committed = re.search(r'outcome="committed",task="guess"\} (\S+)', m)
    assert committed and float(committed.group(1)) > 0, m
    assert "deadlettered" not in m, m
