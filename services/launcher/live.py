"""Live view of a local run: service health, learner progress, queues, version lag.

On a terminal it is a rich view redrawn every second, sized for an 80x24 terminal (a title
line with step N of M and the ETA, one line of service health, a two-column table of
figures); otherwise (CI, `make demo` in a pipe) one plain progress line every
``plain_every_s`` seconds. The training signals shown are the two that say most about a
policy-gradient run's health, when the loss reports them: the clip fraction and the
approximate KL to the policy the batch was sampled from, beside the gradient norm. Items
that never trained are counted beside them: the stale ones, and the ones the learner
dead-lettered as unusable (of them, those too long for ``learner.max_seq_len``).
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
from services.common.heldout import split
from services.launcher import probes

# the loss statistics shown (their key, or any composite's "<term>/<key>")
SIGNALS = ("clip_frac", "approx_kl", "entropy")
MAX_SET_LINES = 3  # eval sets after the first shown one line each, then how many more


def progress(step: int, total: int | None, rl_elapsed_s: float | None) -> tuple[str, float | None]:
    """("N/M" or "N", seconds left at the pace so far or None)."""
    if not total:
        return str(step), None
    left = None
    if rl_elapsed_s and step > 0:
        left = max(total - step, 0) * rl_elapsed_s / step
    return f"{step}/{total}", left


def signal(metrics: dict[str, float], key: str) -> float | None:
    """A loss statistic from a learner scrape (``ludic_learner_train_signal{signal=...}``)."""
    for name, v in metrics.items():
        if name.startswith("ludic_learner_train_signal{") and (
            name.endswith(f"signal={key}}}") or name.endswith(f"/{key}}}")
        ):
            return v
    return None


def fmt(x: Any, spec: str) -> str:
    """``x`` formatted, or "-" when unknown."""
    return "-" if x is None else format(x, spec)


def set_line(name: str, figures: dict[str, float]) -> str:
    """One eval set's last figures in one short line (``-``: not evaluated yet)."""
    line = f"{name[:16]}: pass rate {fmt(figures.get('pass_rate'), '.3f')}"
    if "pass_at_k" in figures:
        line += f"  pass@k {fmt(figures['pass_at_k'], '.3f')}"
    return (
        line + f"  illegal {fmt(figures.get('illegal_rate'), '.3f')}"
        f"  parse err {fmt(figures.get('parse_error_rate'), '.3f')}"
    )


def unusable(tally: Any) -> dict[str, int | None]:
    """The learner's unusable items and, of them, the ones longer than ``max_seq_len``
    (services/launcher/deadletters.py ``DeadLetterTally``; None: not counted)."""
    if tally is None:
        return {"unusable": None, "too_long": None}
    return {"unusable": tally.unusable, "too_long": tally.too_long}


def duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


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
                probes.get(
                    f"{self.run.inference_url}/v1/policy_version", 1.0, self.run.api_key
                ).json()["policy_version"]
            )
        except (httpx.HTTPError, KeyError, ValueError):
            return None

    def snapshot(self) -> dict[str, Any]:
        m = self.run.last_learner
        ev = self.run.evals[-1] if self.run.evals else {}
        learner_v = int(m.get("ludic_learner_policy_version", 0))
        inf_v = self.inference_version()
        step = int(m.get("ludic_learner_step", 0))
        # the pace: the learner's own RL wall (time inside its steps) per step
        steps, eta = progress(
            step, getattr(self.run, "total_steps", None), m.get("ludic_learner_rl_wall_seconds")
        )
        return {
            "elapsed_s": time.monotonic() - self.run.t0,
            "step": step,
            "steps": steps,
            "eta_s": eta,
            "grad_norm": m.get("ludic_learner_grad_norm"),
            **{k: signal(m, k) for k in SIGNALS},
            "loss": m.get("ludic_learner_loss"),
            "reward_mean": m.get("ludic_learner_reward_mean"),
            "samples_per_s": m.get("ludic_learner_samples_per_second"),
            "tokens_per_s": m.get("ludic_learner_tokens_per_second"),
            "stale_dropped": int(m.get("ludic_learner_stale_dropped_total", 0)),
            **unusable(getattr(self.run, "deadletters", None)),
            "publish_failures": int(m.get("ludic_learner_publishes_total{outcome=failed}", 0)),
            "learner_version": learner_v,
            "inference_version": inf_v,
            "version_lag": None if inf_v is None else learner_v - inf_v,
            "queues": self.queues(),
            "pass_rate": ev.get("eval/pass_rate"),
            # every eval set after the first (whose pass rate is "pass_rate"): its figures
            "other_sets": split(
                ev, [s.name for s in getattr(self.run.s, "parsed_eval_sets", [])][1:]
            ),
        }

    def render(self) -> Group:
        """At most ~14 lines and 80 columns, whatever the number of actors."""
        snap = self.snapshot()
        title = (
            f"[bold]{self.run.s.name}[/]  step {snap['steps']}  ETA {duration(snap['eta_s'])}"
            f"  elapsed {duration(snap['elapsed_s'])}"
        )
        restarts = self.run.sup.restarts
        healthy, other = 0, []
        for name, proc in self.run.sup.procs.items():
            alive = proc.poll() is None
            if alive and self.run.sup.healthy(name):
                healthy += 1
            elif alive:
                other.append(f"[yellow]{name} starting[/]")
            else:
                other.append(f"[red]{name} exited {proc.returncode}[/]")
        again = ", ".join(f"{n} x{k}" for n, k in restarts.items() if k)
        if len(other) > 3:  # many at once (a start-up, a crash wave): keep it to one line or two
            other = other[:3] + [f"{len(other) - 3} more not healthy"]
        services = f"services: [green]{healthy} healthy[/]" + "".join(f", {o}" for o in other)
        if again:
            services += f"; restarted: {again}"
        q = snap["queues"]
        lag = snap["version_lag"]
        pairs = [
            ("reward", fmt(snap["reward_mean"], ".3f"), "pass rate", fmt(snap["pass_rate"], ".3f")),
            (
                "samples/s",
                fmt(snap["samples_per_s"], ".1f"),
                "tokens/s",
                fmt(snap["tokens_per_s"], ".0f"),
            ),
            ("loss", fmt(snap["loss"], ".4f"), "grad norm", fmt(snap["grad_norm"], ".3f")),
            (
                "clip frac",
                fmt(snap["clip_frac"], ".3f"),
                "approx KL",
                fmt(snap["approx_kl"], ".4f"),
            ),
            (
                "entropy",
                fmt(snap["entropy"], ".3f"),
                "unusable",
                f"{fmt(snap['unusable'], 'd')} ({fmt(snap['too_long'], 'd')} too long)",
            ),
            (
                "version",
                f"{snap['learner_version']} (inference {fmt(snap['inference_version'], 'd')})",
                "lag",
                fmt(lag, "d"),
            ),
            (
                "stale dropped",
                str(snap["stale_dropped"]),
                "publish fails",
                str(snap["publish_failures"]),
            ),
            (
                "queues",
                f"req {q.get('requests', '-')} roll {q.get('rollouts', '-')}",
                "",
                f"saw {q.get('saw', '-')} dead {q.get('deadletter', '-')}",
            ),
        ]
        stats = Table(show_header=False, box=None, padding=(0, 1))
        for _ in range(4):
            stats.add_column(no_wrap=True)
        for row in pairs:
            stats.add_row(*row)
        others = list(snap["other_sets"].items())
        sets = [f"eval {set_line(n, f)}" for n, f in others[:MAX_SET_LINES]]
        if len(others) > MAX_SET_LINES:
            sets.append(f"eval: {len(others) - MAX_SET_LINES} more sets in summary.json")
        error = getattr(self.run, "error", None)
        if error:  # why the run is stopping (a failing task, a timeout): the last frame says it
            return Group(title, services, stats, *sets, f"[bold red]stopped:[/] {error}")
        return Group(title, services, stats, *sets)

    def plain_line(self) -> str:
        s = self.snapshot()
        q = s["queues"]
        return (
            f"[{s['elapsed_s']:6.0f}s] step {s['steps']} eta {duration(s['eta_s'])} "
            f"reward {fmt(s['reward_mean'], '.3f')} "
            f"samples/s {fmt(s['samples_per_s'], '.1f')} stale {s['stale_dropped']} "
            f"unusable {fmt(s['unusable'], 'd')} too_long {fmt(s['too_long'], 'd')} "
            f"grad_norm {fmt(s['grad_norm'], '.3f')} clip_frac {fmt(s['clip_frac'], '.3f')} "
            f"approx_kl {fmt(s['approx_kl'], '.4f')} entropy {fmt(s['entropy'], '.3f')} "
            f"version learner {s['learner_version']} inference {s['inference_version']} "
            f"publish failures {s['publish_failures']} restarts {sum(self.run.sup.restarts.values())} "
            f"queues req={q.get('requests', '-')} roll={q.get('rollouts', '-')} saw={q.get('saw', '-')} "
            f"dead={q.get('deadletter', '-')} pass_rate {fmt(s['pass_rate'], '.3f')}"
            + "".join(
                f" {n} pass_rate {fmt(f.get('pass_rate'), '.3f')}"
                for n, f in s["other_sets"].items()
            )
        )

    def update(self) -> None:
        error = getattr(self.run, "error", None)
        if self._live is not None:
            self._live.update(self.render())
        elif error or time.monotonic() - self._last_plain >= self.plain_every_s:
            self._last_plain = time.monotonic()
            print(self.plain_line() + (f" STOPPED: {error}" if error else ""), flush=True)


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
