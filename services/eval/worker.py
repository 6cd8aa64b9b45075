"""The held-out evaluator: metrics and ``EvalService`` (watch the learner step, wait
for inference to serve its version, run every eval set). ``main.py`` wires it into a process.

The unlabelled gauges are the first set's (what a one-set run always exported); the
``ludic_eval_set_*`` gauges carry every set's figures (libludic/eval/metrics.py) with labels
``set`` and ``role`` (``all``, or a multi-agent role), truncations also ``reason``.
"""

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
from services.common.eval_tensorboard import write_scalars
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
# figure -> its gauge, labelled by set and role (libludic/eval/metrics.py defines each)
SET_GAUGES = {
    figure: Gauge(f"ludic_eval_set_{name}", text, ["set", "role"])
    for figure, name, text in (
        ("pass_rate", "pass_rate", "Greedy pass rate: episodes whose env return >= threshold"),
        ("reward_mean", "reward_mean", "Greedy mean total reward per episode"),
        ("episode_len_mean", "episode_len_mean", "Greedy model calls per episode"),
        ("parse_error_rate", "parse_error_rate", "Greedy model calls whose reply did not parse"),
        ("illegal_rate", "illegal_rate", "Greedy episodes with an illegal/invalid action"),
        ("pass_at_k", "pass_at_k", "Problems with at least one of k sampled episodes passing"),
        ("mean_at_k", "mean_at_k", "Mean pass over the k sampled episodes per problem"),
        ("num_episodes", "episodes", "Greedy episodes of the last evaluation"),
    )
}
TRUNCATED = Gauge(
    "ludic_eval_set_truncated_rate",
    "Greedy episodes cut short, by reason (max_steps, context_length, parse_error, env)",
    ["set", "role", "reason"],
)
SET_DURATION = Gauge("ludic_eval_set_duration_seconds", "Wall time of the set's pass", ["set"])


def export(per_set: dict[str, dict[str, float]]) -> None:
    """Set the ``ludic_eval_set_*`` gauges from ``{set: {figure[/role]: value}}``."""
    for name, figures in per_set.items():
        for key, value in figures.items():
            figure, _, role = key.partition("/")
            role = role or "all"
            if figure in SET_GAUGES:
                SET_GAUGES[figure].labels(set=name, role=role).set(value)
            elif figure.startswith("truncated_rate_"):
                reason = figure.removeprefix("truncated_rate_")
                TRUNCATED.labels(set=name, role=role, reason=reason).set(value)
            elif figure == "seconds":
                SET_DURATION.labels(set=name).set(value)


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
                res = await heldout.evaluate_sets(self.url, s.parsed_sets, s.api_key)
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
        per_set = heldout.split(res, [x.name for x in s.parsed_sets])
        export(per_set)
        RUNS.inc()
        self.results.append(res)
        log.info(
            "eval step %d (policy v%d) in %.1fs: %s",
            step,
            int(res["eval/policy_version"]),
            res["duration_s"],
            "; ".join(
                f"{x.name} pass rate {per_set[x.name]['pass_rate']:.3f} over {x.n}"
                for x in s.parsed_sets
            ),
        )
        if s.output_file:
            p = Path(s.output_file)
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "a") as f:
                f.write(json.dumps(res) + "\n")
        if s.tensorboard_dir:
            write_scalars(s.tensorboard_dir, per_set, step)
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
