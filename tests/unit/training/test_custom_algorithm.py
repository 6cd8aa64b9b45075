"""A run config names a credit assigner and a loss directly (``algorithm: {name: custom}``),
composite losses included; misspellings list what is known."""

from __future__ import annotations

import pytest

from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.training.credit_assignment import GroupNormalizedReturn, NormalizedReturn
from libludic.training.loss import CompositeLoss, TokenClippedSurrogateLoss, TokenKLLoss


def spec(**kwargs) -> AlgorithmSpec:
    return AlgorithmSpec.from_mapping({"name": "custom", "group_size": 4, "kwargs": kwargs})


def test_a_credit_assigner_and_a_composite_loss_named_in_the_config() -> None:
    algo = spec(
        credit={"kind": "GroupNormalizedReturn", "kwargs": {"normalize_adv": True}},
        loss={
            "kind": "CompositeLoss",
            "kwargs": {
                "terms": [
                    {
                        "name": "pg",
                        "loss": {
                            "kind": "TokenClippedSurrogateLoss",
                            "kwargs": {
                                "eps_clip": 0.1,
                                "off_policy": {"mismatch_correction": "tis"},
                            },
                        },
                    },
                    {"name": "kl", "coeff": 0.05, "loss": {"kind": "TokenKLLoss"}},
                ]
            },
        },
        dynamic_sampling=True,
    ).build()
    ca, loss = algo.credit_assigner, algo.loss
    assert isinstance(ca, GroupNormalizedReturn) and ca.group_size == 4 and ca.normalize_adv
    assert isinstance(loss, CompositeLoss) and [t.name for t in loss.terms] == ["pg", "kl"]
    pg, kl = loss.terms
    assert isinstance(pg.loss, TokenClippedSurrogateLoss) and pg.loss.eps_clip == 0.1
    assert pg.loss.off_policy.mismatch_correction == "tis" and pg.coeff == 1.0
    assert isinstance(kl.loss, TokenKLLoss) and kl.coeff == 0.05
    assert algo.needs_ref_logprobs and algo.needs_actor_logprobs and algo.dynamic_sampling
    # the group size of a partial group reaches the assigner too
    assert (
        spec(credit="GroupNormalizedReturn", loss="ReinforceLoss")
        .build(2)
        .credit_assigner.group_size
        == 2
    )


def test_normalisation_mappings_reach_normalized_return() -> None:
    algo = spec(
        credit={
            "kind": "NormalizedReturn",
            "kwargs": {"reward_norm": {"mean_level": "group", "std_level": None}},
        },
        loss="ReinforceLoss",
    ).build()
    ca = algo.credit_assigner
    assert isinstance(ca, NormalizedReturn) and ca.reward_norm.mean_level == "group"
    assert ca.reward_norm.std_level is None


def test_a_misspelt_off_policy_key_lists_the_known_ones() -> None:
    loss = {
        "kind": "TokenClippedSurrogateLoss",
        "kwargs": {"off_policy": {"mismatch_corection": "tis"}},
    }
    with pytest.raises(
        ValueError,
        match=r"algorithm.kwargs.loss TokenClippedSurrogateLoss: unknown off_policy key\(s\) "
        r"\['mismatch_corection'\]; known: \['mismatch_correction', 'mismatch_level', "
        r"'mismatch_cap', 'recompute_logprob', 'use_decoupled_loss', 'behav_imp_weight_cap'\]",
    ):
        spec(credit="MonteCarloReturn", loss=loss)
    loss["kwargs"] = {"off_policy": "tis"}
    with pytest.raises(
        ValueError, match=r"off_policy must be a mapping of \['mismatch_correction'"
    ):
        spec(credit="MonteCarloReturn", loss=loss)
    loss["kwargs"] = {"off_policy": {"mismatch_correction": "ois"}}
    with pytest.raises(ValueError, match="off_policy: mismatch_correction='ois'; use one of"):
        spec(credit="MonteCarloReturn", loss=loss)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss": "ReinforceLoss"}, "needs kwargs.credit and kwargs.loss"),
        (
            {"credit": "GroupNormalised", "loss": "ReinforceLoss"},
            r"credit.kind='GroupNormalised' is unknown; registered: \[ConstantCredit, "
            r"GroupNormalizedReturn.*did you mean 'GroupNormalizedReturn'",
        ),
        (
            {
                "credit": "MonteCarloReturn",
                "loss": {"kind": "ReinforceLoss", "kwargs": {"aggregate": "x"}},
            },
            r"unknown keyword\(s\) \['aggregate'\]; known: \['aggregation'.*did you mean "
            r"'aggregation'",
        ),
        (
            {"credit": {"kind": "MonteCarloReturn", "kwags": {}}, "loss": "ReinforceLoss"},
            r"unknown key\(s\) \['kwags'\]",
        ),
        (
            {"credit": "MonteCarloReturn", "loss": {"kind": "CompositeLoss"}},
            "CompositeLoss needs kwargs.terms",
        ),
        (
            {
                "credit": "MonteCarloReturn",
                "loss": {"kind": "TokenKLLoss", "kwargs": {"estimator": "k9"}},
            },
            "TokenKLLoss: .*k9",
        ),
    ],
)
def test_a_bad_custom_algorithm_is_refused_naming_what_is_known(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        spec(**kwargs)
