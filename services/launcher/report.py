"""End of a run: ``summary.json`` and a reward / pass-rate curve PNG.

Items that never trained: ``stale_dropped`` (older than ``learner.max_lag``),
``unusable_items`` (dead-lettered by the learner as no step could train them) and, of those,
``too_long_items`` (longer than ``learner.max_seq_len`` even with the prompt cut), with every
reason of the learner's dead letters in ``learner_deadletters``.

Evaluation in the summary (each evaluation of ``Run.evals`` holds every eval set's figures
as ``eval/<set>/<figure>``, services/common/heldout.py): ``pass_rate_before/after/delta``
are the first set's greedy pass rate; ``evals`` has one entry per evaluation and set
(``set``, ``label`` before|curve|after, ``step``, ``wall_s``, ``eval_s`` the set's seconds,
its figures as ``eval/<figure>``); ``eval_sets`` maps each set to its config, ``before`` and
``after`` figures, ``delta_pass_rate`` and ``eval_seconds`` (its curve evaluations' time,
apart from the RL wall like the run's ``eval_seconds``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from libludic.transport import accounting
from services.common.heldout import split

PLACE = ("step", "wall_s", "rl_wall_s")  # where an evaluation sits on the run's clocks


def set_names(run: Any) -> list[str]:
    return [s.name for s in getattr(run.s, "parsed_eval_sets", [])]


def eval_entries(
    run: Any, before: dict[str, float] | None, after: dict[str, float] | None
) -> list[dict[str, Any]]:
    """``Run.evals`` as one entry per (evaluation, set), in evaluation then set order."""
    out = []
    for e in run.evals:
        label = "before" if e is before else "after" if e is after else "curve"
        for name, figures in split(e, set_names(run)).items():
            if figures:
                out.append(
                    {
                        "set": name,
                        "label": label,
                        **{k: e[k] for k in PLACE if k in e},
                        "eval_s": figures.get("seconds", e.get("eval_s")),
                        **{f"eval/{k}": v for k, v in figures.items() if k != "seconds"},
                    }
                )
    return out


def eval_sets_block(
    run: Any, before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, Any]:
    """``{set: {config..., before, after, delta_pass_rate, eval_seconds}}``."""
    names = set_names(run)
    b = split(before or {}, names)
    a = split(after or {}, names)
    curve = [e for e in run.evals if e is not before and e is not after]
    out: dict[str, Any] = {}
    for s in getattr(run.s, "parsed_eval_sets", []):
        fb = {k: v for k, v in b[s.name].items() if k != "seconds"} or None
        fa = {k: v for k, v in a[s.name].items() if k != "seconds"} or None
        out[s.name] = {
            **{k: v for k, v in s.to_dict().items() if k != "name"},
            "before": fb,
            "after": fa,
            "delta_pass_rate": None if not fb or not fa else fa["pass_rate"] - fb["pass_rate"],
            "eval_seconds": round(sum(e.get(f"eval/{s.name}/seconds", 0.0) for e in curve), 1),
        }
    return out


def build_summary(
    run: Any,
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    ok: bool,
    error: str | None = None,
) -> dict[str, Any]:
    m = run.last_learner
    wall = time.monotonic() - run.t0
    trained = int(m.get("ludic_learner_items_trained_total", 0))
    # one definition (libludic/training/trainer.py): trained items per second of the
    # learner's RL wall (inside its train steps, evaluation excluded), as the learner
    # reported it at exit; the launcher's clock (learner start-up included) if it did not
    learner_rl = getattr(run, "learner_rl", {}) or {}
    rl_wall = learner_rl.get("rl_wall_seconds")
    if rl_wall is None:
        rl_wall = getattr(run, "rl_t1", time.monotonic()) - getattr(run, "rl_t0", run.t0)
    sps = learner_rl.get("samples_per_second")
    if sps is None:
        sps = round(trained / rl_wall, 2) if rl_wall > 0 else None
    dead = getattr(run, "deadletters", None)  # services/launcher/deadletters.py
    pb = None if before is None else before["eval/pass_rate"]
    pa = None if after is None else after["eval/pass_rate"]
    return {
        "ok": ok,
        # why a failed run stopped (a service that failed for good, a start-up that never
        # became healthy, up.timeout_s, the learner's exit code); None for a run that succeeded
        "error": error,
        "run_id": run.run_id,
        "pass_rate_before": pb,
        "pass_rate_after": pa,
        "pass_rate_delta": None if pb is None or pa is None else pa - pb,
        "eval_n": run.s.eval_n,
        "steps": int(m.get("ludic_learner_step", 0)),
        "samples_trained": trained,
        "stale_dropped": int(m.get("ludic_learner_stale_dropped_total", 0)),
        # items the learner dead-lettered as no step could train them (unusable_item), and of
        # them the ones longer than learner.max_seq_len; every reason of its dead letters
        "unusable_items": 0 if dead is None else dead.unusable,
        "too_long_items": 0 if dead is None else dead.too_long,
        "learner_deadletters": {} if dead is None else dict(sorted(dead.by_reason.items())),
        # the version inference acknowledged last (the learner's version only moves on an ack)
        "policy_version": int(m.get("ludic_learner_policy_version", 0)),
        "publish_failures": getattr(run, "publish", {}).get(
            "publish_failures", int(m.get("ludic_learner_publishes_total{outcome=failed}", 0))
        ),
        "final_policy_served": getattr(run, "publish", {}).get("final_policy_served"),
        "last_publish_error": getattr(run, "publish", {}).get("last_publish_error"),
        "wall_seconds": round(wall, 1),
        "rl_wall_seconds": round(rl_wall, 1),
        "samples_per_second": sps,
        "eval_mode": run.s.eval_mode,
        # time spent in curve evaluations: concurrent with training (live: it cost its CPU
        # share of the RL wall) or after it (deferred: it cost the RL wall nothing)
        "eval_seconds": round(getattr(run, "curve_eval_s", 0.0), 1),
        "actors": run.s.actors,
        # service -> times `ludic up` restarted it after it exited (up.max_restarts)
        "restarts": dict(getattr(getattr(run, "sup", None), "restarts", {}) or {}),
        # service -> seconds from each exit to its restarted process's first health pass
        "recovery_seconds": dict(getattr(getattr(run, "sup", None), "recoveries", {}) or {}),
        # service -> times the watchdog killed it, alive but stuck (up.watchdog_timeout_s)
        "watchdog_kills": dict(getattr(getattr(run, "sup", None), "watchdog_kills", {}) or {}),
        # libludic/transport/accounting.py, read from Redis when the learner finished (services running)
        "accounting": getattr(run, "accounting", None),
        # per eval set: its config, before / after figures, their pass-rate delta, curve time
        "eval_sets": eval_sets_block(run, before, after),
        "evals": eval_entries(run, before, after),
        "curve": run.curve,
    }


EVAL_COLOURS = ("tab:red", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink")


def plot(summary: dict[str, Any], path: Path) -> None:
    """Train reward mean per learner step (left axis) and one greedy pass-rate line per
    eval set (right axis)."""
    import matplotlib  # the plot only, and its Agg backend chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    fig, ax1 = plt.subplots(figsize=(7, 4))
    curve = [c for c in summary["curve"] if not math.isnan(c.get("reward_mean", float("nan")))]
    if curve:
        ax1.plot(
            [c["step"] for c in curve],
            [c["reward_mean"] for c in curve],
            color="tab:blue",
            alpha=0.6,
            label="train reward mean",
        )
    ax1.set_xlabel("learner step")
    ax1.set_ylabel("train reward mean", color="tab:blue")
    ax2 = ax1.twinx()
    sets = summary.get("eval_sets") or {}
    for i, (name, cfg) in enumerate(sets.items()):
        points = [e for e in summary["evals"] if e.get("set") == name]
        if points:
            ax2.plot(
                [e["step"] for e in points],
                [e["eval/pass_rate"] for e in points],
                "o-",
                color=EVAL_COLOURS[i % len(EVAL_COLOURS)],
                label=f"{name} (n={cfg.get('n')})",
            )
    if len(sets) > 1:
        ax2.legend(loc="lower right", fontsize="small")
    ax2.set_ylabel("held-out greedy pass rate", color="tab:red" if len(sets) < 2 else "black")
    ax2.set_ylim(0, 1)
    ax1.set_title(
        f"{summary['run_id']}: pass rate {summary['pass_rate_before']} -> {summary['pass_rate_after']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fmt_pass(figures: dict[str, float] | None) -> str:
    """``0.412`` (greedy) or ``0.412 (pass@k 0.700)``; ``-`` when not evaluated."""
    if not figures:
        return "-"
    at_k = figures.get("pass_at_k")
    return f"{figures['pass_rate']:.3f}" + ("" if at_k is None else f" (pass@k {at_k:.3f})")


def write_report(
    run: Any,
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    ok: bool,
    error: str | None = None,
) -> dict[str, Any]:
    summary = build_summary(run, before, after, ok, error)
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(summary, run.run_dir / "curves.png")
    t = Table(title=f"summary ({run.run_dir}/summary.json, curves.png)")
    t.add_column("metric")
    t.add_column("value")
    for k in (
        "pass_rate_before",
        "pass_rate_after",
        "pass_rate_delta",
        "steps",
        "samples_trained",
        "stale_dropped",
        "unusable_items",
        "too_long_items",
        "policy_version",
        "publish_failures",
        "final_policy_served",
        "wall_seconds",
        "rl_wall_seconds",
        "samples_per_second",
        "eval_seconds",
        "restarts",
        "recovery_seconds",
        "watchdog_kills",
    ):
        v = summary[k]
        if k in ("restarts", "watchdog_kills"):
            v = ", ".join(f"{n} {c}" for n, c in sorted(v.items())) or "none"
        elif k == "recovery_seconds":
            v = ", ".join(f"{n} {'/'.join(map(str, c))}" for n, c in sorted(v.items())) or "none"
        t.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    for name, block in list(summary["eval_sets"].items())[1:]:  # the first is above
        t.add_row(f"{name} pass rate", " -> ".join(fmt_pass(block[w]) for w in ("before", "after")))
    if error is not None:
        t.add_row("error", error.splitlines()[0] if error else "?")
    Console().print(t)
    Console().print(accounting.format_line(summary["accounting"]))
    return summary
