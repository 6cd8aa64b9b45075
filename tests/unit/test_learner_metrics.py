"""The learner's wait-for-items gauge, the actors' autoscaling signal (helm KEDA trigger)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.learner import metrics as M
from services.learner.tracker import TensorBoardConfig, TrackerConfig


def test_wait_share_rises_while_the_learner_starves_and_falls_when_items_pile_up() -> None:
    avg = M.WaitAverage(alpha=0.5)
    # first step: 0.3 s of a 0.4 s step waiting -> 0.75
    assert avg.add(0.3, 0.4) == pytest.approx(0.75)
    # starving harder: wait 0.9 of a 1.0 s step; averages (0.6, 0.7) -> 0.857
    assert avg.add(0.9, 1.0) == pytest.approx(0.6 / 0.7)
    # items waiting in the stream: no wait at all; averages (0.3, 0.45) -> 0.667, then
    # (0.15, 0.325) -> 0.4615: falling towards 0
    assert avg.add(0.0, 0.2) == pytest.approx(0.3 / 0.45)
    assert avg.add(0.0, 0.2) == pytest.approx(0.15 / 0.325)
    assert avg.add(0.0, 0.2) < 0.3


def test_the_exported_gauge_moves_in_both_directions() -> None:
    M.WAIT_AVERAGE.__init__()  # type: ignore[misc]  # a fresh average for this test

    def gauge() -> float:
        return REGISTRY.get_sample_value("ludic_learner_batch_wait_fraction") or 0.0

    base = {"step": 1.0, "loss": 0.0, "batch_items": 0.0}
    M.export_step({**base, "batch_wait_s": 0.5, "step_wall_s": 0.6})
    high = gauge()
    assert high == pytest.approx(0.5 / 0.6)
    seen = []
    for _ in range(10):  # the learner stops waiting: down at every step
        M.export_step({**base, "batch_wait_s": 0.0, "step_wall_s": 0.25})
        seen.append(gauge())
    assert all(b < a for a, b in zip([high, *seen], seen))
    # alpha 0.2: wait 0.5 * 0.8^10 = 0.054, step 0.25 + 0.35 * 0.8^10 = 0.288 -> 0.187
    assert seen[-1] == pytest.approx(0.5 * 0.8**10 / (0.25 + 0.35 * 0.8**10))
    for _ in range(10):  # and starves again: up at every step
        M.export_step({**base, "batch_wait_s": 0.4, "step_wall_s": 0.5})
        seen.append(gauge())
    assert all(b > a for a, b in zip(seen[9:], seen[10:]))


def test_the_losss_statistics_are_exported_as_training_signals() -> None:
    from libludic.training.algorithm_spec import AlgorithmSpec

    loss = (
        AlgorithmSpec.from_mapping(
            {"name": "grpo", "group_size": 4, "kwargs": {"mismatch_correction": "tis"}}
        )
        .build()
        .loss
    )
    stats = {
        "step": 2.0,
        "loss": 0.1,
        "batch_items": 0.0,
        "batch_wait_s": 0.0,
        "step_wall_s": 1.0,
        "loss/clip_frac": 0.125,
        "loss/mismatch_logprob_gap": 0.03,
        "loss/other": 9.0,
    }
    M.export_step(stats, tuple(loss.stat_keys))

    def signal(name: str) -> float | None:
        return REGISTRY.get_sample_value("ludic_learner_train_signal", {"signal": name})

    assert signal("clip_frac") == 0.125 and signal("mismatch_logprob_gap") == 0.03
    assert signal("other") is None and signal("loss") is None  # only the loss's own keys


def test_the_batchs_advantage_mean_and_std_are_exported_as_training_signals() -> None:
    from libludic.training.loss import ReinforceBaselineLoss

    stats = {
        "step": 3.0,
        "loss": 0.0,
        "batch_items": 0.0,
        "batch_wait_s": 0.0,
        "step_wall_s": 1.0,
        "adv_mean": 0.25,  # step stats (ranks.weight_stats), not loss/<key>
        "adv_std": 1.5,
        "loss/entropy": 2.0,
    }
    M.export_step(stats, tuple(ReinforceBaselineLoss.stat_keys))

    def signal(name: str) -> float | None:
        return REGISTRY.get_sample_value("ludic_learner_train_signal", {"signal": name})

    assert M.STEP_SIGNALS == ("adv_mean", "adv_std")
    assert signal("adv_mean") == 0.25 and signal("adv_std") == 1.5 and signal("entropy") == 2.0


def test_the_step_stats_and_dynamic_sampling_drops_reach_tensorboard(tmp_path) -> None:
    """StepLogger writes one scalar per key and step; read back with TensorBoard's own
    reader. The groups dynamic sampling dropped come from the run accounting, read after
    each step, as a running total."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the dev extras)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = M.StepLogger(TrackerConfig(tensorboard=TensorBoardConfig(path=str(tmp_path))))
    steps = [
        ({"step": 1.0, "lr": 1e-4, "loss/entropy": 2.5, "num_minibatches": 2.0}, 3),
        ({"step": 2.0, "lr": 5e-5, "loss/entropy": 2.0, "num_minibatches": 2.0}, 7),
    ]
    for stats, dropped in steps:
        logger.step(M.logged_stats(stats, {"groups_zero_variance": dropped, "other": 1}))
    logger.close()
    ev = EventAccumulator(str(tmp_path))
    ev.Reload()

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in ev.Scalars(tag)]

    assert series("lr") == [(1, pytest.approx(1e-4)), (2, pytest.approx(5e-5))]
    assert series("loss/entropy") == [(1, 2.5), (2, 2.0)]
    assert series("num_minibatches") == [(1, 2.0), (2, 2.0)]
    assert series("run/dynamic_sampling_dropped_total") == [(1, 3.0), (2, 7.0)]
    assert "other" not in ev.Tags()["scalars"]  # only the accounting's RUN_STEP_SIGNALS


def test_the_run_accounting_exports_the_dynamic_sampling_drops() -> None:
    from libludic.transport import accounting

    a = accounting.compute(
        {"groups_requested": 5, "groups_dropped_empty": 3, "groups_zero_variance": 2},
        {"requests_backlog": 2, "rolling": 0, "open": 0, "saw_backlog": 0},
    )
    # 5 requested - 3 dropped empty = 2 in flight, both waiting as requests: consistent
    assert a["groups_zero_variance"] == 2 and a["consistent"]
    M.export_accounting(a)
    assert REGISTRY.get_sample_value("ludic_run_groups_zero_variance_total") == 2
