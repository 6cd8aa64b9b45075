"""`ludic up`'s live view: step N of M with an ETA, the key training signals, 80x24."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

from rich.console import Console

from services.launcher.live import LiveView, duration, progress, signal


def test_progress_and_eta_at_the_pace_so_far() -> None:
    # 25 of 100 steps in 50 s: 2 s a step, 75 left -> 150 s
    assert progress(25, 100, 50.0) == ("25/100", 150.0)
    assert progress(0, 100, 5.0) == ("0/100", None)  # no pace yet
    assert progress(7, None, 10.0) == ("7", None)  # a run without an end
    assert progress(120, 100, 60.0) == ("120/100", 0.0)
    assert duration(150.0) == "2:30" and duration(3725.0) == "1:02:05" and duration(None) == "-"


def test_signals_are_read_from_the_learner_scrape_plain_or_composite() -> None:
    m = {
        "ludic_learner_train_signal{signal=clip_frac}": 0.125,
        "ludic_learner_train_signal{signal=pg/approx_kl}": 0.004,
        "ludic_learner_train_signal{signal=dual_clip_frac}": 0.5,
    }
    assert signal(m, "clip_frac") == 0.125  # not dual_clip_frac
    assert signal(m, "approx_kl") == 0.004  # the pg term of a composite loss
    assert signal(m, "mismatch_kl") is None


class Proc:
    def __init__(self, code: int | None) -> None:
        self.returncode = code
        self.pid = 4242

    def poll(self) -> int | None:
        return self.returncode


def fake_run(actors: int) -> SimpleNamespace:
    procs = {
        "redis": Proc(None), "inference": Proc(None), "feeder": Proc(None),
        "credit": Proc(None), "learner": Proc(None),
    }  # fmt: skip
    procs.update({f"actor-{i}": Proc(None) for i in range(actors)})
    procs["actor-1"] = Proc(1)  # 21 services: 19 healthy, credit starting, actor-1 exited
    sup = SimpleNamespace(
        procs=procs,
        restarts={"actor-1": 2},
        healthy=lambda name: name != "credit",
    )
    now = time.monotonic()
    return SimpleNamespace(
        s=SimpleNamespace(name="arith-grpo"),
        run_id="arith-grpo",
        sup=sup,
        t0=now - 100.0,
        total_steps=100,
        evals=[{"eval/pass_rate": 0.655}],
        redis_url="redis://127.0.0.1:9/0",  # nothing listens: queues unknown
        inference_url="http://127.0.0.1:9",
        api_key="k",
        last_learner={
            "ludic_learner_step": 30.0,
            "ludic_learner_rl_wall_seconds": 60.0,
            "ludic_learner_policy_version": 30.0,
            "ludic_learner_samples_per_second": 220.5,
            "ludic_learner_grad_norm": 1.75,
            "ludic_learner_train_signal{signal=clip_frac}": 0.0625,
            "ludic_learner_train_signal{signal=approx_kl}": 0.0012,
            "ludic_learner_train_signal{signal=entropy}": 1.875,
        },
    )


def test_the_view_fits_80x24_with_many_actors_and_says_what_matters() -> None:
    run = fake_run(actors=16)
    view = LiveView(run, enabled=False)
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(view.render())
    lines = out.getvalue().rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(x) for x in lines) <= 80, out.getvalue()
    text = out.getvalue()
    # 30 of 100 steps in 60 s of the learner's RL wall: 70 left at 2 s each
    assert "step 30/100" in text and "ETA 2:2" in text
    assert "19 healthy" in text and "credit starting" in text and "actor-1 exited 1" in text
    assert "actor-1 x2" in text
    for figure in ("0.655", "220.5", "1.750", "0.062", "0.0012", "1.875"):
        assert figure in text, figure
    line = view.plain_line()
    assert (
        "step 30/100 eta 2:2" in line and "clip_frac 0.062" in line and "approx_kl 0.0012" in line
    )
    assert "entropy 1.875" in line


def test_a_wave_of_unhealthy_services_stays_on_the_screen() -> None:
    run = fake_run(actors=40)
    run.sup.healthy = lambda name: False  # everything starting at once
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(LiveView(run, enabled=False).render())
    text = out.getvalue()
    assert len(text.rstrip("\n").split("\n")) <= 24
    words = " ".join(text.split())  # the services line may wrap at 80 columns
    assert "services: 0 healthy" in words and "42 more not healthy" in words  # 45 - 3 named


def test_the_learners_unusable_items_are_shown_beside_the_signals() -> None:
    run = fake_run(actors=2)
    # DeadLetterTally's counts: 3 items dead-lettered as unusable, 2 of them too long
    run.deadletters = SimpleNamespace(unusable=3, too_long=2)
    view = LiveView(run, enabled=False)
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(view.render())
    lines = out.getvalue().rstrip("\n").split("\n")
    assert max(len(x) for x in lines) <= 80
    assert any("entropy" in x and "unusable 3 (2 too long)" in " ".join(x.split()) for x in lines)
    assert "unusable 3 too_long 2" in view.plain_line()
    del run.deadletters  # not counted (yet): unknown, not 0
    assert "unusable - too_long -" in LiveView(run, enabled=False).plain_line()
