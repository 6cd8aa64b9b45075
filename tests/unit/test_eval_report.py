"""Where ``ludic up``'s evaluation figures go, with two eval sets and faked evaluations:
summary.json (the first set's headline pass rates, per-set ``eval_sets`` and ``evals``),
curves.png (one pass-rate line per set), TensorBoard scalars ``eval/<set>/<figure>`` at the
learner step, and the live view (the first set's pass rate, one line per other set)."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path
from typing import Any

import matplotlib
import pytest
import yaml
from rich.console import Console

from services.common.eval_tensorboard import UP_EVENTS_DIR
from services.common.heldout import flatten
from services.common.settings import load_settings
from services.launcher import report, worker
from services.launcher.live import LiveView
from services.launcher.settings import UpSettings
from services.launcher.worker import Run

SETS = [
    {"name": "add", "env": {"kind": "arithmetic", "kwargs": {"split": "eval"}}, "n": 4},
    {
        "name": "selfplay",
        "env": {"kind": "tic_tac_toe_2p"},
        "protocol": {"kind": "multi_agent", "kwargs": {"roles": ["X", "O"]}},
        "n": 2,
        "max_steps": 10,
        "k": 4,
    },
]
# what the fake evaluations report, before / curve / after (steps 0, 10, 20)
ADD = [0.25, 0.5, 0.75]
SELFPLAY_X = [0.0, 0.5, 1.0]
AT_K = [0.5, 0.5, 1.0]


def fake_results(i: int) -> dict[str, dict[str, float]]:
    return {
        "add": {"pass_rate": ADD[i], "reward_mean": ADD[i], "policy_version": i, "seconds": 3.0},
        "selfplay": {
            "pass_rate": SELFPLAY_X[i] / 2,  # O never wins in this fake
            "pass_rate/X": SELFPLAY_X[i],
            "pass_rate/O": 0.0,
            "illegal_rate": 0.125,
            "pass_at_k": AT_K[i],
            "policy_version": i,
            "seconds": 5.0,
        },
    }


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Run:
    cfg = {"up": {"name": "e1", "runs_dir": str(tmp_path / "runs"), "eval_sets": SETS}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    s = load_settings(UpSettings, ["--config", str(path)], service="up", environ={})
    r = Run(s)
    r.inference_url = "http://127.0.0.1:9"  # nothing listens: versions unknown
    r.redis_url = "redis://127.0.0.1:9/0"  # queues unknown
    calls: list[int] = []

    def fake_served(url: str, sets: Any, api_key: str | None = None) -> dict[str, float]:
        assert api_key  # ludic up's evaluations send the run's generation token
        assert [x.name for x in sets] == ["add", "selfplay"] and sets[1].k == 4
        calls.append(1)
        return flatten(fake_results(len(calls) - 1))

    monkeypatch.setattr(worker, "evaluate_served", fake_served)
    return r


def evaluate_three_times(run: Run) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    run.t0 = time.monotonic()
    before = run.eval_now("before", 0)
    run.rl_t0 = time.monotonic()
    run.eval_now("curve", 10)
    after = run.eval_now("after", 20)
    run.last_learner = {"ludic_learner_step": 20.0}
    return before, after


def test_the_summary_holds_every_sets_figures(run: Run) -> None:
    before, after = evaluate_three_times(run)
    report.write_report(run, before, after, ok=True)
    s = json.loads((run.run_dir / "summary.json").read_text())
    # the headline stays the first set's greedy pass rate
    assert (s["pass_rate_before"], s["pass_rate_after"]) == (0.25, 0.75)
    assert s["pass_rate_delta"] == pytest.approx(0.5)
    sp = s["eval_sets"]["selfplay"]
    assert (sp["k"], sp["n"], sp["max_steps"], sp["env"]) == (4, 2, 10, {"kind": "tic_tac_toe_2p"})
    assert sp["before"]["pass_rate/X"] == 0.0 and sp["after"]["pass_rate/X"] == 1.0
    assert sp["after"]["pass_at_k"] == 1.0 and sp["after"]["illegal_rate"] == 0.125
    assert sp["delta_pass_rate"] == pytest.approx(0.5)  # 1.0/2 - 0.0/2
    assert s["eval_sets"]["add"]["delta_pass_rate"] == pytest.approx(0.5)
    # curve evaluations' time per set (the one curve evaluation: 3 s and 5 s)
    assert (s["eval_sets"]["add"]["eval_seconds"], sp["eval_seconds"]) == (3.0, 5.0)
    # one entry per evaluation and set, its figures under eval/<figure>
    assert [(e["set"], e["label"], e["step"]) for e in s["evals"]] == [
        ("add", "before", 0.0),
        ("selfplay", "before", 0.0),
        ("add", "curve", 10.0),
        ("selfplay", "curve", 10.0),
        ("add", "after", 20.0),
        ("selfplay", "after", 20.0),
    ]
    assert [e["eval/pass_rate"] for e in s["evals"] if e["set"] == "add"] == ADD
    assert [e["eval_s"] for e in s["evals"]] == [3.0, 5.0] * 3
    assert [e["eval/policy_version"] for e in s["evals"]][-1] == 2


def test_curves_png_has_one_pass_rate_line_per_set(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, after = evaluate_three_times(run)
    summary = report.build_summary(run, before, after, ok=True)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to read its lines
    report.plot(summary, run.run_dir / "curves.png")
    assert (run.run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = kept
    lines = fig.axes[1].get_lines()
    assert [ln.get_label() for ln in lines] == ["add (n=4)", "selfplay (n=2)"]
    assert [list(ln.get_ydata()) for ln in lines] == [ADD, [x / 2 for x in SELFPLAY_X]]
    assert list(lines[0].get_xdata()) == [0.0, 10.0, 20.0]


def test_tensorboard_gets_every_sets_figures_at_the_learner_step(run: Run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    evaluate_three_times(run)
    acc = EventAccumulator(str(run.run_dir / UP_EVENTS_DIR))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"eval/add/pass_rate", "eval/selfplay/pass_rate/X", "eval/selfplay/pass_at_k"} <= tags
    assert not any(t.count("/") == 1 for t in tags)  # no set-less duplicates of the first set

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]

    assert series("eval/add/pass_rate") == list(zip([0, 10, 20], ADD, strict=True))
    assert series("eval/selfplay/pass_rate/X") == list(zip([0, 10, 20], SELFPLAY_X, strict=True))


def test_the_live_view_shows_one_line_per_other_set(run: Run) -> None:
    evaluate_three_times(run)
    view = LiveView(run, enabled=False)
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(view.render())
    lines = out.getvalue().rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(x) for x in lines) <= 80, out.getvalue()
    assert re.search(r"pass rate\s+0\.750", out.getvalue())  # the first set's, as always
    (line,) = [x for x in lines if x.startswith("eval ")]
    assert line.split() == (
        "eval selfplay: pass rate 0.500 pass@k 1.000 illegal 0.125 parse err -".split()
    )
    assert view.plain_line().endswith("pass_rate 0.750 selfplay pass_rate 0.500")
