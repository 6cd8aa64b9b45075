"""The presets' shared options (libludic/training/preset_options.py): one set of defaults,
the same keys accepted by the factories as by the run config, unknown keys refused."""

from __future__ import annotations

import pytest

from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.training.loss import OffPolicyCorrection
from libludic.training.preset_options import (
    GroupOptions,
    LossOptions,
    PolicyGradientOptions,
    PresetOptions,
    RewardOptions,
    option_keys,
    preset_arguments,
)
from libludic.training.presets import ALGORITHMS, make_cispo, make_grpo, make_scalerl
from libludic.training.rewards import RewardShaping


def test_option_groups_nest() -> None:
    assert option_keys(RewardOptions) < option_keys(LossOptions) < option_keys(GroupOptions)
    assert option_keys(GroupOptions) < option_keys(PolicyGradientOptions)
    assert option_keys(PolicyGradientOptions) - option_keys(GroupOptions) == {
        "kl_coeff",
        "kl_estimator",
        "kl_in_reward",
    }


def test_defaults_are_the_library_dataclasses() -> None:
    o = PresetOptions.parse("grpo", {}, PolicyGradientOptions)
    assert o.shaping == RewardShaping() and o.off_policy == OffPolicyCorrection()
    assert (o.aggregation, o.kl_coeff, o.kl_estimator, o.kl_in_reward, o.dynamic_sampling) == (
        "token-mean",
        0.0,
        "k3",
        False,
        False,
    )


def test_every_preset_argument_is_accepted_by_the_run_config() -> None:
    budget = {"max_new_tokens": 64, "overlong_tokens": 16}  # dapo's overlong shaping
    for name, factory in ALGORITHMS.items():
        args = preset_arguments(factory)
        assert ("group_size" in args) == (name not in ("reinforce", "sft", "ppo"))
        if name != "custom":  # custom needs a credit and a loss (test_custom_algorithm.py)
            kw = budget if name == "dapo" else {}
            assert AlgorithmSpec(name=name, kwargs=dict(kw)).build().name == name
    # the KL term: every policy-gradient preset but scalerl
    assert "kl_coeff" in preset_arguments(make_grpo) and "kl_coeff" in preset_arguments(make_cispo)
    assert "kl_coeff" not in preset_arguments(make_scalerl)
    assert "filter_zvp" in preset_arguments(make_scalerl)


def test_unknown_option_is_refused_by_factory_and_spec() -> None:
    with pytest.raises(TypeError, match=r"make_scalerl\(\) got unexpected keyword.*kl_coeff"):
        make_scalerl(kl_coeff=0.1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="not arguments of make_scalerl"):
        AlgorithmSpec(name="scalerl", kwargs={"kl_coeff": 0.1})


def test_options_reach_loss_credit_and_reward() -> None:
    algo = make_grpo(
        kl_coeff=0.05,
        aggregation="seq-mean-token-mean",
        reward_scaling=2.0,
        dynamic_sampling=True,
        mismatch_correction="tis",
        reward_norm={"mean_level": "group", "std_level": None},
    )
    pg, kl = algo.loss.terms  # type: ignore[attr-defined]
    assert pg.loss.aggregation == "seq-mean-token-mean" and kl.coeff == 0.05
    assert pg.loss.off_policy.mismatch_correction == "tis"
    assert algo.reward_shaping is not None and algo.reward_shaping.reward_scaling == 2.0
    assert algo.preprocess is not None
    assert type(algo.credit_assigner).__name__ == "NormalizedReturn"
    with pytest.raises(ValueError, match="kl_coeff"):
        make_grpo(kl_coeff=-1.0)
