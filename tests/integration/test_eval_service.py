"""``ludic eval`` against a real redis-server and a real ``ludic inference`` (vLLM, tiny
model): the gauge ``ludic_eval_pass_rate`` equals the held-out pass rate computed directly
with the same greedy pass, and ``ludic_eval_step`` names the learner step it belongs to.

Run alone (one vLLM at a time): ``flock /tmp/ludic-vllm.lock pytest -m vllm
tests/integration/test_eval_service.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_server import InferenceServer  # noqa: E402

from libludic import transport as t  # noqa: E402
from services.common import heldout  # noqa: E402
from services.launcher.stack import free_port, scrape  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
ENV = {"kind": "arithmetic", "kwargs": {"split": "eval"}}


def wait_metrics(url: str, cond: Any, timeout: float, proc: Any, log: Path) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m and cond(m):
            return m
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"timed out; last scrape {m}\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def test_eval_service_exports_the_pass_rate_of_each_evaluated_step(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Settings come from the run config's ``up:`` section (eval_env, eval_n=12,
    eval_every_steps=2, eval_max_tokens=8). Learner at step 0 -> one evaluation (at_start);
    step 1 is not due; step 3 >= 2 is -> a second one, ``ludic_eval_step`` 3. Greedy decoding
    of unchanged weights is deterministic, so both equal the directly computed pass rate."""
    srv = InferenceServer(tiny_model_dir, free_port(), None, tmp_path / "inference.log")
    srv.start()
    proc = None
    try:
        expect = asyncio.run(heldout.evaluate(srv.url, ENV, 12, 8))
        assert expect["eval/num_episodes"] == 12
        run, keys = "ev1", t.Keys("ev1")
        r = redis.Redis.from_url(redis_server.url)
        r.set(keys.learner_step, 0)
        r.set(keys.policy_version, 0)
        cfg = tmp_path / "run.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "run_id": run,
                    "up": {
                        "eval_env": ENV,
                        "eval_n": 12,
                        "eval_every_steps": 2,
                        "eval_max_tokens": 8,
                    },
                }
            )
        )
        port = free_port()
        out = tmp_path / "evals.jsonl"
        env = dict(
            os.environ,
            LUDIC_CONFIG=str(cfg),
            LUDIC_REDIS_URL=redis_server.url,
            LUDIC_INFERENCE_URLS=srv.url,
            LUDIC_METRICS_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        log = tmp_path / "eval.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.cli",
                    "eval",
                    "--poll-s",
                    "0.2",
                    "--settle-s",
                    "0",
                    "--output-file",
                    str(out),
                ],
                cwd=REPO,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        murl = f"http://127.0.0.1:{port}/metrics"
        m = wait_metrics(murl, lambda m: m.get("ludic_eval_runs_total", 0) >= 1, 180, proc, log)
        assert m["ludic_eval_step"] == 0
        assert m["ludic_eval_pass_rate"] == pytest.approx(expect["eval/pass_rate"])
        assert m["ludic_eval_reward_mean"] == pytest.approx(expect["eval/reward_mean"])
        assert m["ludic_eval_policy_version"] == 0
        r.set(keys.learner_step, 1)
        time.sleep(2.0)  # 10 polls: step 1 is not a multiple-of-2 boundary
        assert scrape(murl)["ludic_eval_runs_total"] == 1
        r.set(keys.learner_step, 3)
        m = wait_metrics(murl, lambda m: m.get("ludic_eval_runs_total", 0) >= 2, 180, proc, log)
        assert m["ludic_eval_step"] == 3
        assert m["ludic_eval_pass_rate"] == pytest.approx(expect["eval/pass_rate"])
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert [x["step"] for x in lines] == [0, 3]
        assert all(x["eval/num_episodes"] == 12 for x in lines)
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        srv.stop()
