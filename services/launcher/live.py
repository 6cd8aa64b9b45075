"""Live view of a local run: service health, learner progress, queues, version lag.

On a terminal it is a rich table redrawn every second; otherwise (CI, `make demo` in a
pipe) one plain progress line every ``plain_every_s`` seconds.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from libludic.transport import Keys, stream_lengths_sync


class LiveView:
    def __init__(self, run: Any, enabled: bool, plain_every_s: float = 10.0) -> None:
        self.run = run
        self.enabled = enabled
        self.plain_every_s = plain_every_s
        self._last_plain = 0.0
        self._live: Live | None = None
        self._redis: redis.Redis | None = None
        self.console = Console()

    def __enter__(self) -> LiveView:
        if self.enabled:
            self._live = Live(
                self.render(), console=self.console, refresh_per_second=2, transient=False
            )
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
        if self._redis is not None:
            self._redis.close()

    def queues(self) -> dict[str, int]:
        try:
            if self._redis is None:
                self._redis = redis.Redis.from_url(self.run.redis_url, socket_timeout=1.0)
            return stream_lengths_sync(self._redis, Keys(self.run.run_id).streams())
        except (redis.RedisError, OSError):
            return {}

    def inference_version(self) -> int | None:
        try:
            return int(
                httpx.get(f"{self.run.inference_url}/v1/policy_version", timeout=1.0).json()[
                    "policy_version"
                ]
            )
        except (httpx.HTTPError, KeyError, ValueError):
            return None

    def snapshot(self) -> dict[str, Any]:
        m = self.run.last_learner
        ev = self.run.evals[-1] if self.run.evals else {}
        learner_v = int(m.get("ludic_learner_policy_version", 0))
        inf_v = self.inference_version()
        return {
            "elapsed_s": time.monotonic() - self.run.t0,
            "step": int(m.get("ludic_learner_step", 0)),
            "loss": m.get("ludic_learner_loss"),
            "reward_mean": m.get("ludic_learner_reward_mean"),
            "samples_per_s": m.get("ludic_learner_samples_per_second"),
            "tokens_per_s": m.get("ludic_learner_tokens_per_second"),
            "stale_dropped": int(m.get("ludic_learner_stale_dropped_total", 0)),
            "publish_failures": int(m.get("ludic_learner_publishes_total{outcome=failed}", 0)),
            "learner_version": learner_v,
            "inference_version": inf_v,
            "version_lag": None if inf_v is None else learner_v - inf_v,
            "queues": self.queues(),
            "pass_rate": ev.get("eval/pass_rate"),
        }

    def render(self) -> Group:
        snap = self.snapshot()
        services = Table(title="services", expand=False)
        for c in ("service", "pid", "state", "restarts"):
            services.add_column(c)
        restarts = self.run.sup.restarts
        for name, proc in self.run.sup.procs.items():
            alive = proc.poll() is None
            healthy = alive and self.run.sup.healthy(name)
            state = (
                "[green]healthy"
                if healthy
                else ("[yellow]starting" if alive else f"[red]exited {proc.returncode}")
            )
            services.add_row(name, str(proc.pid), state, str(restarts.get(name, 0)))
        stats = Table(title=f"run {self.run.run_id}", expand=False)
        stats.add_column("metric")
        stats.add_column("value")
        for k, v in snap.items():
            if k == "queues":
                v = "  ".join(f"{q}={n}" for q, n in v.items())
            elif isinstance(v, float):
                v = f"{v:.3f}"
            stats.add_row(k, str(v))
        return Group(services, stats)

    def plain_line(self) -> str:
        s = self.snapshot()
        q = s["queues"]
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        return (
            f"[{s['elapsed_s']:6.0f}s] step {s['step']} reward {fmt(s['reward_mean'], '.3f')} "
            f"samples/s {fmt(s['samples_per_s'], '.1f')} stale {s['stale_dropped']} "
            f"version learner {s['learner_version']} inference {s['inference_version']} "
            f"publish failures {s['publish_failures']} restarts {sum(self.run.sup.restarts.values())} "
            f"queues req={q.get('requests', '-')} roll={q.get('rollouts', '-')} saw={q.get('saw', '-')} "
            f"dead={q.get('deadletter', '-')} pass_rate {fmt(s['pass_rate'], '.3f')}"
        )

    def update(self) -> None:
        if self._live is not None:
            self._live.update(self.render())
        elif time.monotonic() - self._last_plain >= self.plain_every_s:
            self._last_plain = time.monotonic()
            print(self.plain_line(), flush=True)


def summary_lines(summary: dict[str, Any]) -> list[str]:
    keys = (
        "pass_rate_before",
        "pass_rate_after",
        "steps",
        "samples_trained",
        "stale_dropped",
        "wall_seconds",
        "samples_per_second",
    )
    return [f"{k:>20}: {summary.get(k)}" for k in keys]
