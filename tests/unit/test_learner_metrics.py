"""The learner's wait-for-items gauge, the actors' autoscaling signal (helm KEDA trigger)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.learner import metrics as M


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
    from libludic.training.presets import AlgorithmSpec

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
