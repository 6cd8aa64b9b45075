"""A user's own package in containers (README "Bring your own environment"), on a real engine.

The user's image is built FROM the project's (examples/custom_env/Dockerfile, through the
compose override examples/custom_env/deploy/compose.yaml); then

* fail fast: with a misspelt env kind in the run config, the feeder, actor and eval
  containers exit 2 within seconds, each naming the key, the value and the choices;
* the package resolves: every ludic service of the override runs the user's image, in which
  `ludic check` of the shipped config finds the package's env, tool, reward function and
  eval set through their entry points.

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
    if not (ROOT / ".env").exists() or not (ROOT / "deploy/compose/secrets/users.acl").exists():
        pytest.fail(
            ".env or the Redis users (deploy/compose/secrets) are missing: `make compose-env`"
        )
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


def test_every_service_runs_the_users_image_and_resolves_its_package(built):
    """The override puts the user's image under every ludic service, and in it the shipped
    config resolves: the task's env, tool and reward and the eval set come from the
    package's entry points (`ludic check`, the start-up check each service runs). The
    package training through the services is test_up_plugins.py (`ludic up`); the services
    training in compose is test_compose_e2e.py: the two together, a 3-step run here, took
    201 s of the container tier and were folded into this check to keep CI short."""
    services = json.loads(compose("config", "--format", "json").stdout)["services"]
    for name in ("model-init", "feeder", "actor", "credit", "learner", "eval"):
        assert services[name]["image"] == "ludic-guess:cpu", (name, services[name]["image"])
    t0 = time.monotonic()
    p = compose("run", "--rm", "--no-deps", "actor", "check", "--config", "/etc/ludic/config.yaml")
    REPORT["check_s"] = round(time.monotonic() - t0, 1)
    out = p.stdout + p.stderr
    assert re.search(r"ok\s+feeder.tasks\[0\] guess: env guess, protocol single_agent, "
                     r"agent tool, rewards fewer_guesses", out), out[-3000:]  # fmt: skip
    assert re.search(r"ok\s+eval set guess: env guess", out), out[-3000:]
