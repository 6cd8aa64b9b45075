"""Reward options before credit: DAPO's overlong penalty, AReaL's scaling / bias / clip and
the no-EOS mask, worked by hand, through the presets and from the algorithm: section."""

from __future__ import annotations

import math

import pytest

from libludic.training.algorithm import CreditStats, RLAlgorithm
from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.training.presets import make_grpo, make_reinforce, make_scalerl
from libludic.training.rewards import RewardShaping
from tests.fakes import make_rollout

RL_PRESETS = ["reinforce", "grpo", "cispo", "gspo", "dr_grpo", "scalerl"]


def spec(section: dict) -> RLAlgorithm:
    return AlgorithmSpec.from_mapping(section).build()


def completion(n: int) -> tuple[int, ...]:
    return tuple(range(4, 4 + n))


def test_overlong_penalty_is_linear_over_the_last_overlong_tokens() -> None:
    sh = RewardShaping(
        overlong_reward_penalty=True,
        overlong_tokens=4,
        overlong_penalty_factor=1.0,
        max_new_tokens=10,
    )
    # expected length 10 - 4 = 6; p(L) = min(-(L - 6) / 4 * 1.0, 0)
    # L=5 -> min(+0.25, 0) = 0;  L=6 -> 0;  L=8 -> -0.5;  L=10 -> -1.0
    assert [sh.overlong_penalty(n) for n in (0, 5, 6, 8, 10)] == pytest.approx(
        [0, 0, 0, -0.5, -1.0]
    )
    half = RewardShaping(
        overlong_reward_penalty=True,
        overlong_tokens=4,
        overlong_penalty_factor=0.5,
        max_new_tokens=10,
    )
    assert half.overlong_penalty(8) == pytest.approx(-0.25)  # -(2 / 4) * 0.5
    assert RewardShaping().overlong_penalty(10) == 0.0  # off by default (AReaL)


def test_penalty_then_bias_then_scaling_then_clip() -> None:
    sh = RewardShaping(
        reward_scaling=2.0,
        reward_bias=0.5,
        reward_clip=5.0,
        overlong_reward_penalty=True,
        overlong_tokens=4,
        overlong_penalty_factor=1.0,
        max_new_tokens=10,
    )
    (r,) = sh.apply([make_rollout("a", [1.0], completion=completion(8))])
    # (1 + p(8) + 0.5) * 2 = (1 - 0.5 + 0.5) * 2 = 2.0
    assert r.steps[0].reward == pytest.approx(2.0)
    (r,) = sh.apply([make_rollout("b", [3.0], completion=completion(2))])
    # (3 + 0 + 0.5) * 2 = 7 -> clipped to 5
    assert r.steps[0].reward == 5.0
    (r,) = RewardShaping(reward_clip=5.0).apply([make_rollout("c", [-10.0])])
    assert r.steps[0].reward == -5.0
    (r,) = RewardShaping().apply([make_rollout("d", [30.0])])
    assert r.steps[0].reward == 20.0  # AReaL's default reward_clip


def test_shaping_leaves_the_input_rollouts_alone() -> None:
    orig = make_rollout("a", [1.0, 2.0])
    (shaped,) = RewardShaping(reward_scaling=3.0).apply([orig])
    assert [s.reward for s in orig.steps] == [1.0, 2.0]
    assert [s.reward for s in shaped.steps] == [3.0, 6.0] and shaped.meta is orig.meta


def test_overlong_penalty_through_grpo_and_dynamic_sampling() -> None:
    # both answers right (reward 1); b used the whole budget of 10 tokens: p(10) = -1
    rs = [
        make_rollout("a", [1.0], "g", completion=completion(4)),
        make_rollout("b", [1.0], "g", completion=completion(10)),
    ]
    kw = {
        "overlong_reward_penalty": True,
        "overlong_tokens": 4,
        "overlong_penalty_factor": 1.0,
        "max_new_tokens": 10,
    }
    items = make_grpo(group_size=2, **kw).to_saw_items(rs)
    # shaped totals (1, 0), mean 0.5 -> A = +0.5, -0.5
    assert [it.weight for it in items] == pytest.approx([0.5, -0.5])
    assert [it.meta["reward"] for it in items] == [1.0, 1.0]  # the task's reward is kept
    assert [it.meta["shaped_reward"] for it in items] == pytest.approx([1.0, 0.0])
    assert [it.meta["step_reward"] for it in items] == [1.0, 1.0]
    # without the penalty the rewards are equal: zero advantage, and dynamic sampling drops it
    assert [it.weight for it in make_grpo(group_size=2).to_saw_items(rs)] == [0.0, 0.0]
    assert make_grpo(group_size=2, dynamic_sampling=True).to_saw_items(rs) == []
    kept = make_grpo(group_size=2, dynamic_sampling=True, **kw).to_saw_items(rs)
    assert len(kept) == 2  # dynamic sampling looks at the shaped rewards


def test_reward_bias_counts_once_per_step() -> None:
    # step rewards (0, 1), bias 0.5 -> (0.5, 1.5); Monte Carlo G_1 = 1.5, G_0 = 0.5 + 1.5 = 2.0
    items = make_reinforce(reward_bias=0.5).to_saw_items([make_rollout("r", [0.0, 1.0])])
    assert [it.weight for it in items] == pytest.approx([2.0, 1.5])
    assert [it.meta["step_reward"] for it in items] == [0.0, 1.0]


def test_reward_scaling_and_clip_through_grpo() -> None:
    rs = [make_rollout("a", [30.0], "g"), make_rollout("b", [0.0], "g")]
    # default clip 20: (20, 0), mean 10 -> +10, -10
    assert [it.weight for it in make_grpo(group_size=2).to_saw_items(rs)] == pytest.approx(
        [10.0, -10.0]
    )
    # scaling 0.1 first: (3, 0) -> +1.5, -1.5
    items = make_grpo(group_size=2, reward_scaling=0.1).to_saw_items(rs)
    assert [it.weight for it in items] == pytest.approx([1.5, -1.5])


def no_eos_group() -> list:
    # rewards (1, 0, 0); c stopped at the token budget (finish_reason "length")
    return [
        make_rollout("a", [1.0], "g"),
        make_rollout("b", [0.0], "g"),
        make_rollout("c", [0.0], "g", info={"finish_reason": "length"}),
    ]


def test_mask_no_eos_with_zero_after_the_group_statistics() -> None:
    # mean 1/3 over all three (c included) -> a 2/3, b -1/3; c masked to 0
    stats = CreditStats()
    items = make_grpo(group_size=3, mask_no_eos_with_zero=True).to_saw_items(
        no_eos_group(), stats=stats
    )
    assert [it.weight for it in items] == pytest.approx([2 / 3, -1 / 3, 0.0])
    assert stats.items_masked_no_eos == 1
    plain = make_grpo(group_size=3).to_saw_items(no_eos_group())
    assert [it.weight for it in plain] == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_mask_no_eos_with_zero_waits_for_the_batch_stage() -> None:
    # ScaleRL: c = (2/3, -1/3, -1/3), batch std = sqrt((4/9 + 1/9 + 1/9) / 3) = sqrt(2/9)
    # -> a = (2/3) / sqrt(2/9) = sqrt(2), b = -(1/3) / sqrt(2/9) = -1/sqrt(2); c masked to 0
    want = [math.sqrt(2), -1 / math.sqrt(2), 0.0]
    algo = make_scalerl(group_size=3, dynamic_sampling=False, mask_no_eos_with_zero=True)
    assert [it.weight for it in algo.to_saw_items(no_eos_group())] == pytest.approx(want, rel=1e-6)
    stats = CreditStats()
    pending = algo.to_saw_items(no_eos_group(), defer_batch_stage=True, stats=stats)
    assert [it.weight for it in pending] == pytest.approx([2 / 3, -1 / 3, -1 / 3])  # not yet
    assert stats.items_masked_no_eos == 1
    assert [it.weight for it in algo.apply_batch_stage(pending)] == pytest.approx(want, rel=1e-6)


def test_reward_options_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="overlong_reward_penalty needs max_new_tokens"):
        make_grpo(overlong_reward_penalty=True, overlong_tokens=4, overlong_penalty_factor=1.0)
    with pytest.raises(
        ValueError, match=r"overlong_tokens=20 must be an integer in \[1, max_new_tokens=10\]"
    ):
        make_grpo(
            overlong_reward_penalty=True,
            overlong_tokens=20,
            overlong_penalty_factor=1.0,
            max_new_tokens=10,
        )
    with pytest.raises(ValueError, match="overlong_penalty_factor=None must be a number >= 0"):
        make_grpo(overlong_reward_penalty=True, overlong_tokens=4, max_new_tokens=10)
    with pytest.raises(
        ValueError, match="overlong_tokens set but overlong_reward_penalty is false"
    ):
        make_grpo(overlong_tokens=4)
    with pytest.raises(ValueError, match="reward_clip=0.0 must be > 0"):
        make_grpo(reward_clip=0.0)
    with pytest.raises(ValueError, match="mask_no_eos_with_zero='yes' must be true or false"):
        make_grpo(mask_no_eos_with_zero="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rollout n step 0 has a non-finite reward nan"):
        make_grpo(group_size=1).to_saw_items([make_rollout("n", [float("nan")])])
    with pytest.raises(ValueError, match="no TokenTrace: the overlong penalty needs"):
        RewardShaping(
            overlong_reward_penalty=True,
            overlong_tokens=4,
            overlong_penalty_factor=1.0,
            max_new_tokens=10,
        ).apply([make_rollout("t", [1.0], trace=False)])


@pytest.mark.parametrize("name", RL_PRESETS)
def test_reward_options_from_the_algorithm_section(name) -> None:
    algo = spec(
        {
            "name": name,
            "group_size": 4,
            "kwargs": {
                "overlong_reward_penalty": True,
                "overlong_tokens": 128,
                "overlong_penalty_factor": 0.5,
                "max_new_tokens": 512,
                "reward_scaling": 2.0,
                "reward_bias": -0.5,
                "reward_clip": 4.0,
                "mask_no_eos_with_zero": True,
            },
        }
    )
    assert algo.reward_shaping == RewardShaping(
        reward_scaling=2.0,
        reward_bias=-0.5,
        reward_clip=4.0,
        overlong_reward_penalty=True,
        overlong_tokens=128,
        overlong_penalty_factor=0.5,
        max_new_tokens=512,
    )
    assert algo.mask_no_eos_with_zero
    default = spec({"name": name})
    budget = 1024 if name == "dr_grpo" else None  # the preset's max_new_tokens
    assert default.reward_shaping == RewardShaping(max_new_tokens=budget)
    assert not default.mask_no_eos_with_zero
    with pytest.raises(ValueError, match=rf"algorithm '{name}'.*overlong_tokens set but"):
        spec({"name": name, "kwargs": {"overlong_tokens": 4}})


def test_dr_grpos_budget_is_the_overlong_penaltys_max_length() -> None:
    algo = spec(
        {
            "name": "dr_grpo",
            "kwargs": {
                "overlong_reward_penalty": True,
                "overlong_tokens": 256,
                "overlong_penalty_factor": 1.0,
            },
        }
    )
    assert algo.reward_shaping is not None and algo.reward_shaping.max_new_tokens == 1024
    assert algo.loss.max_new_tokens == 1024  # one budget for the loss and the penalty
    assert spec({"name": "sft"}).reward_shaping is None  # SFT ignores rewards
