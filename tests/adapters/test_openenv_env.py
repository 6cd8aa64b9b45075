"""The ``openenv`` env kind: an OpenEnv server played through the real rollout engine.

The server is a real openenv-core 0.3.0 app (examples/openenv/guess_server.py),
started on a free loopback port from the openenv side venv, which the project's venv
cannot hold (openenv-core's gradio pins pillow<13); the adapter itself needs only
websockets and httpx. Create the side venv once, then run these in the project's venv:

    bash scripts/adapter-venvs.sh openenv     # runs/venvs/openenv, idempotent
    .venv/bin/python -m pytest tests/adapters/test_openenv_env.py

Without that venv (or without websockets) the tests skip and say so.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("websockets", reason="the openenv kind needs: pip install libludic[openenv]")

from libludic import plugins  # noqa: E402
from libludic.envs.openenv import OpenEnvEnv, ws_url  # noqa: E402
from libludic.registry import build_registries  # noqa: E402
from libludic.requests import EnvSpec, RolloutRequest  # noqa: E402
from libludic.rollout.engine import RolloutEngine  # noqa: E402
from services.launcher.stack import free_port  # noqa: E402
from tests.fakes import ScriptedClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("LUDIC_ADAPTER_VENVS", ROOT / "runs" / "venvs")) / "openenv"
SERVER = ROOT / "examples" / "openenv" / "guess_server.py"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    python = VENV / "bin" / "python"
    if not python.exists():
        why = f"no openenv side venv at {VENV}: bash scripts/adapter-venvs.sh openenv"
        if os.environ.get("LUDIC_REQUIRE_ADAPTER_VENVS") == "1":  # make test: never a skip
            pytest.fail(why)
        pytest.skip(why)
    port = free_port()
    proc = subprocess.Popen(
        [str(python), str(SERVER), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # importing openenv-core takes ~10 s on 2 cores
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"OpenEnv server exited {proc.returncode}: {proc.stdout}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"OpenEnv server on {base} not healthy in 120 s")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bisect(request) -> str:
    """Guess the midpoint of what the hints so far leave of 1..8."""
    lo, hi, guess = 1, 8, None
    for m in request.messages:
        if m["role"] == "assistant":
            guess = int(m["content"])
        elif m["role"] == "user" and guess is not None:
            lo, hi = (guess + 1, hi) if m["content"] == "higher" else (lo, guess - 1)
    return str((lo + hi) // 2)


def test_the_kind_is_registered():
    assert plugins.resolve("envs", "openenv") is OpenEnvEnv


def test_ws_url_follows_openenvs_client():
    assert ws_url("http://h:8000/") == "ws://h:8000/ws"
    assert ws_url("https://h") == "wss://h/ws"
    assert ws_url("h:1") == "ws://h:1/ws"


async def test_episode_over_a_real_server(url):
    client = ScriptedClient(["3", "x", "6", "5"])
    engine = RolloutEngine(*build_registries(client))
    req = RolloutRequest(env=EnvSpec("openenv", {"url": url}), env_seed=4)
    (rollout,) = await engine.generate_rollouts([req], max_steps=10)
    # secret 4 % 8 + 1 = 5. "3": higher, -0.1; "x": not an integer, rejected by the server's
    # action model without a step, 0; "6": lower, -0.1; "5": right, 1.0 -> 0.8 in all
    assert [s.reward for s in rollout.steps] == [-0.1, 0.0, -0.1, 1.0]
    assert rollout.total_reward == pytest.approx(0.8)
    assert rollout.steps[0].prev_obs == "Guess my number in 1..8."
    assert [s.next_obs for s in rollout.steps[::2]] == ["higher", "lower"]
    assert rollout.steps[1].next_obs.startswith("Invalid action: guess: Input should be")
    assert rollout.steps[1].info["invalid_action"] is True
    assert rollout.steps[-1].terminated and rollout.steps[-1].next_obs == "right"


async def test_concurrent_episodes_have_their_own_sessions(url):
    engine = RolloutEngine(*build_registries(ScriptedClient([bisect])))
    req = RolloutRequest(env=EnvSpec("openenv", {"url": url}), env_seed=0, num_episodes=4)
    rollouts = await engine.generate_rollouts([req], max_steps=6, concurrency=4)
    # seeds 0..3 -> secrets 1..4; bisection guesses 4 first, then halves what is left:
    # 1: 4, 2, 1 (2 wrong); 2: 4, 2 (1); 3: 4, 2, 3 (2); 4: 4 (0); r = 1.0 - 0.1 * wrong
    assert [[s.action for s in r.steps] for r in rollouts] == [
        ["4", "2", "1"],
        ["4", "2"],
        ["4", "2", "3"],
        ["4"],
    ]
    assert [r.total_reward for r in rollouts] == pytest.approx([0.8, 0.9, 0.8, 1.0])


def test_json_actions_and_a_chosen_observation_field(url):
    env = OpenEnvEnv(url, json_action=True, observation_field="guesses")
    try:
        assert env.reset(seed=1)["agent"][0] == "0"
        out = env.step({"agent": "five"})["agent"]
        assert out.info["invalid_action"] and "JSON object" in out.obs
        out = env.step({"agent": '{"guess": 2}'})["agent"]
        assert (out.obs, out.reward, out.terminated) == ("1", 1.0, True)
    finally:
        env.close()


def test_max_steps_truncates_and_the_session_closes(url):
    env = OpenEnvEnv(url)
    env.reset(seed=7)
    assert not env.step({"agent": "1"})["agent"].terminated
    env.close()
    with pytest.raises(RuntimeError, match="step\\(\\) before reset\\(\\)"):
        env.step({"agent": "8"})


def test_no_server_names_the_url():
    port = free_port()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}: GET /schema failed"):
        OpenEnvEnv(f"http://127.0.0.1:{port}")


def test_the_example_config_builds(url):
    # examples/openenv/grpo.yaml, checked as `ludic check` and the services do, against this
    # test's server instead of the example's fixed port
    import yaml

    from libludic.tasks import check_task, parse_tasks

    cfg = yaml.safe_load((ROOT / "examples" / "openenv" / "grpo.yaml").read_text())
    tasks = cfg["feeder"]["tasks"]
    for t in tasks:
        t["env"]["kwargs"]["url"] = url
    for i, task in enumerate(parse_tasks(tasks, "feeder.tasks")):
        check_task(task, f"feeder.tasks[{i}]")
