"""A user's own package through `ludic up`, and a task that fails at run time stopping it.

* examples/custom_env (``ludic_guess``, installed by ``make venv`` as a user would install it
  with ``pip install -e examples/custom_env``): its env, tool and reward function, named by
  the short names its entry points register, train through the real services unchanged
  except for a small budget (flags and ``LUDIC_*`` env, as a user gives them).
* A task whose env passes the start-up check but raises on every request: the run stops on
  its own within seconds of the tenth dead letter (``up.deadletter_stop_after``), exit 1,
  with the reason and the first dead letter's detail in summary.json and the log, instead of
  dead-lettering until ``up.timeout_s``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from libludic import transport

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.up, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def up(
    cfg: Path, tmp_path: Path, model: Path, redis_url: str, *flags: str
) -> tuple[int, str, float]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "LUDIC_REDIS_URL": redis_url,
        "LUDIC_NUM_STEPS": str(STEPS),
        "LUDIC_BATCH_SIZE": "16",
    }
    argv = [
        sys.executable, "-m", "services.cli", "up", "--config", str(cfg), "--model", str(model),
        "--runs-dir", str(tmp_path / "runs"), "--actors", "1", "--eval-n", "4",
        "--eval-every-steps", "2", "--timeout-s", "540", "--startup-timeout-s", "240",
        "--sft-steps", "0", "--no-live", *flags,
    ]  # fmt: skip
    log = tmp_path / "up.log"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT
    )
    try:
        code = proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, log.read_text(errors="replace"), time.monotonic() - t0


class RolloutWatcher(threading.Thread):
    """Copies every rollout that passes through the stream (credit XDELs on commit).

    A blocking XREAD, not a poll: Redis answers a reader blocked on the stream right after the
    XADD that wakes it, before credit (which needs a round trip) can XDEL the entry. A poll
    every 50 ms missed every rollout of a fast run once (CI: credit commits a group within
    milliseconds of its last rollout)."""

    def __init__(self, url: str, run_id: str):
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.key = transport.Keys(run_id).rollouts
        self.rollouts: dict[bytes, Any] = {}
        self.done = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        last = b"0-0"
        while not self.done.is_set():
            try:
                reply = self.r.xread({self.key: last}, count=1000, block=200)
            except redis.RedisError as e:
                self.errors.append(repr(e))
                time.sleep(0.05)
                continue
            for _, entries in reply or []:
                for eid, fields in entries:
                    try:
                        self.rollouts[eid] = transport.decode_rollout(fields[b"d"])
                    except Exception as e:  # noqa: BLE001 - reported by the test
                        self.errors.append(f"{eid!r}: {e!r}")
                    last = eid


def test_a_users_package_trains_through_the_services(tmp_path, tiny_model_dir, redis_url):
    cfg = REPO / "examples/custom_env/grpo.yaml"
    run_id = yaml.safe_load(cfg.read_text())["run_id"]
    r = redis.Redis.from_url(redis_url)
    watcher = RolloutWatcher(redis_url, run_id)
    watcher.start()
    try:
        code, log, _ = up(cfg, tmp_path, tiny_model_dir, redis_url, "--name", "guess")
    finally:
        watcher.done.set()
        watcher.join(5)
    assert code == 0, log[-4000:]
    summary = json.loads((tmp_path / "runs/guess/summary.json").read_text())
    assert summary["steps"] >= STEPS and summary["samples_trained"] >= STEPS * 16
    assert summary["evals"][-1]["eval/policy_version"] > summary["evals"][0]["eval/policy_version"]
    assert r.xlen(transport.Keys(run_id).deadletter) == 0
    # the actors built the package's env, tool and reward function from their short names
    ros = list(watcher.rollouts.values())
    assert ros, f"no rollout was seen; the watcher's errors: {watcher.errors[:5]}"
    assert all(ro.steps[0].prev_obs.startswith("Between ") for ro in ros)  # GuessEnv's prompt
    assert all(set(ro.steps[-1].info["reward_fns"]) == {"fewer_guesses"} for ro in ros)
    assert all(ro.meta["task"] == "guess" for ro in ros)
    assert any(len(ro.steps) > 1 for ro in ros)  # multi-turn: a wrong guess is told higher/lower


def test_a_task_failing_at_run_time_stops_the_run_with_its_reason(
    tmp_path, tiny_model_dir, redis_url
):
    cfg = yaml.safe_load((REPO / "examples/arith/grpo.yaml").read_text())
    cfg["run_id"] = "broken-task"
    cfg["up"].update(name="broken", eval_n=4)
    cfg["feeder"]["tasks"] = [
        {"name": "broken", "env": {"kind": "tests.user_plugins:FailsAfterTheCheck"},
         "inference": {"sampling": {"temperature": 1.0, "max_tokens": 4}}},
    ]  # fmt: skip
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, log, took = up(path, tmp_path, tiny_model_dir, redis_url)
    assert code == 1, log[-4000:]
    summary = json.loads((tmp_path / "runs/broken/summary.json").read_text())
    err = summary["error"]
    assert "task 'broken': its last" in err and "were all dead-lettered" in err, err
    assert "first reason: episode_error: task broken: ValueError: cannot load problem" in err, err
    assert "stopping the run: task 'broken'" in log
    assert summary["steps"] == 0
    print(
        f"a task failing at run time: ludic up exited 1 after {took:.0f} s (vLLM's start included)"
    )
