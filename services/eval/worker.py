"""The held-out evaluator: metrics and ``EvalService`` (watch the learner step, wait
for inference to serve its version, run the greedy pass). ``main.py`` wires it into a process."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import Counter, Gauge

from libludic import transport
from libludic.inference.openai_client import InferenceError, OpenAIChatClient
from services.common import heldout
from services.common.lifecycle import sleep_or_stop
from services.eval.settings import EvalSettings

log = logging.getLogger("ludic.eval")

PASS_RATE = Gauge("ludic_eval_pass_rate", "Held-out greedy pass rate of the last evaluation")
STEP = Gauge("ludic_eval_step", "Learner step the last evaluation belongs to")
VERSION = Gauge("ludic_eval_policy_version", "Policy version inference served during it")
REWARD = Gauge("ludic_eval_reward_mean", "Held-out mean reward of the last evaluation")
DURATION = Gauge("ludic_eval_duration_seconds", "Wall time of the last evaluation")
RUNS = Counter("ludic_eval_runs_total", "Evaluations completed")
ERRORS = Counter("ludic_eval_errors_total", "Failed evaluations / Redis errors", ["kind"])


class EvalService:
    def __init__(self, s: EvalSettings, r: Any, stop: asyncio.Event) -> None:
        self.s, self.r, self.stop = s, r, stop
        self.keys = transport.Keys(s.run_id)
        self.url = s.inference_urls[0]
        self.results: list[dict[str, float]] = []
        self.last_tick = time.monotonic()
        self.evaluating = False

    async def health(self) -> bool:
        return self.evaluating or time.monotonic() - self.last_tick < 3 * self.s.poll_s + 30

    async def _served_version(self) -> int:
        c = OpenAIChatClient(self.url, api_key=self.s.api_key, timeout_s=10.0)
        try:
            return await c.get_policy_version()
        finally:
            await c.aclose()

    async def _wait_for_version(self, want: int) -> None:
        deadline = time.monotonic() + self.s.version_wait_s
        while not self.stop.is_set():
            try:
                if await self._served_version() >= want:
                    return
            except (InferenceError, OSError, httpx.HTTPError) as e:
                log.info("inference %s not answering (%s); waiting", self.url, e)
            if time.monotonic() >= deadline:
                log.warning(
                    "inference %s still behind learner v%d after %.0fs; evaluating anyway",
                    self.url,
                    want,
                    self.s.version_wait_s,
                )
                return
            await sleep_or_stop(self.stop, 1.0)

    async def evaluate(self, step: int) -> dict[str, float] | None:
        """One evaluation for learner ``step``; None (counted) when inference failed."""
        s = self.s
        self.evaluating = True
        try:
            await self._wait_for_version(await transport.get_policy_version(self.r, self.keys))
            t0 = time.monotonic()
            try:
                assert s.env is not None and s.n is not None and s.max_tokens is not None
                res = await heldout.evaluate(
                    self.url, s.env, s.n, s.max_tokens, s.api_key, protocol=s.protocol
                )
            except (InferenceError, OSError, httpx.HTTPError) as e:
                ERRORS.labels(kind="inference").inc()
                log.warning(
                    "evaluation of step %d failed (%s: %s); retrying at the next poll",
                    step,
                    type(e).__name__,
                    e,
                )
                return None
        finally:
            self.evaluating = False
        res["step"] = float(step)
        res["duration_s"] = time.monotonic() - t0
        PASS_RATE.set(res["eval/pass_rate"])
        STEP.set(step)
        VERSION.set(res["eval/policy_version"])
        REWARD.set(res["eval/reward_mean"])
        DURATION.set(res["duration_s"])
        RUNS.inc()
        self.results.append(res)
        log.info(
            "eval step %d (policy v%d): pass rate %.3f over %d in %.1fs",
            step,
            int(res["eval/policy_version"]),
            res["eval/pass_rate"],
            s.n,
            res["duration_s"],
        )
        if s.output_file:
            p = Path(s.output_file)
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "a") as f:
                f.write(json.dumps(res) + "\n")
        return res

    async def run(self) -> None:
        s = self.s
        done: int | None = None  # last evaluated step
        every = int(s.every_steps or 0)
        target: int | None = 0 if s.at_start else (every if every > 0 else None)
        seen, seen_at, attempt = -1, time.monotonic(), 0
        while not self.stop.is_set():
            self.last_tick = time.monotonic()
            try:
                step = await transport.get_int(self.r, self.keys.learner_step)
                attempt = 0
            except transport.REDIS_DOWN_ERRORS as e:
                ERRORS.labels(kind="redis").inc()
                log.warning("redis unavailable (%s); backing off", e)
                await transport.backoff_sleep(attempt, self.stop)
                attempt += 1
                continue
            if step != seen:
                seen, seen_at = step, time.monotonic()
            due = target is not None and step >= target
            settled = s.settle_s > 0 and step > 0 and time.monotonic() - seen_at >= s.settle_s
            if (due or settled) and step != done and await self.evaluate(step) is not None:
                done = step
                target = (step // every + 1) * every if every > 0 else None
                continue
            await sleep_or_stop(self.stop, s.poll_s)
