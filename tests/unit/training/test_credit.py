"""Credit assigners: formulas worked by hand, grouping errors."""

from __future__ import annotations

import math

import pytest

from libludic.training.credit_assignment import (
    ConstantCredit,
    CreditAssigner,
    GroupNormalizedReturn,
    HybridNormalizedReturn,
    MonteCarloReturn,
)
from tests.fakes import make_rollout


def test_all_are_credit_assigners() -> None:
    for a in (
        MonteCarloReturn(),
        GroupNormalizedReturn(2),
        HybridNormalizedReturn(2),
        ConstantCredit(),
    ):
        assert isinstance(a, CreditAssigner)


def test_monte_carlo_discounted_return() -> None:
    r = make_rollout("r", [1.0, 0.0, 2.0])
    w = MonteCarloReturn(gamma=0.5).compute([r])
    # G_2 = 2;  G_1 = 0 + 0.5*2 = 1;  G_0 = 1 + 0.5*1 = 1.5
    assert w == {
        ("r", 0): pytest.approx(1.5),
        ("r", 1): pytest.approx(1.0),
        ("r", 2): pytest.approx(2.0),
    }


def test_monte_carlo_gamma_one_is_reward_to_go() -> None:
    w = MonteCarloReturn().compute([make_rollout("r", [1.0, 2.0, 3.0])])
    assert [w[("r", i)] for i in range(3)] == pytest.approx([6.0, 5.0, 3.0])


def test_group_normalized_centres_within_group() -> None:
    rs = [
        make_rollout("a", [1.0], "g1"),
        make_rollout("b", [0.0], "g1"),
        make_rollout("c", [3.0], "g2"),
        make_rollout("d", [1.0], "g2"),
    ]
    w = GroupNormalizedReturn(group_size=2).compute(rs)
    # g1 mean 0.5 -> +0.5, -0.5;  g2 mean 2 -> +1, -1
    assert w[("a", 0)] == pytest.approx(0.5) and w[("b", 0)] == pytest.approx(-0.5)
    assert w[("c", 0)] == pytest.approx(1.0) and w[("d", 0)] == pytest.approx(-1.0)


def test_group_normalized_std_and_positive_only() -> None:
    rs = [make_rollout(x, [v], "g") for x, v in zip("abc", [0.0, 0.0, 3.0], strict=True)]
    w = GroupNormalizedReturn(group_size=3, normalize_adv=True).compute(rs)
    # mean 1, deviations (-1, -1, 2), population std sqrt((1+1+4)/3) = sqrt(2)
    assert w[("a", 0)] == pytest.approx(-1 / math.sqrt(2))
    assert w[("c", 0)] == pytest.approx(2 / math.sqrt(2))
    wp = GroupNormalizedReturn(group_size=3, positive_only=True).compute(rs)
    assert (wp[("a", 0)], wp[("c", 0)]) == (0.0, pytest.approx(2.0))


def test_group_weight_applies_to_every_step() -> None:
    rs = [make_rollout("a", [1.0, 1.0], "g"), make_rollout("b", [0.0, 0.0], "g")]
    w = GroupNormalizedReturn(group_size=2).compute(rs)
    # totals 2 and 0, mean 1
    assert w[("a", 0)] == w[("a", 1)] == pytest.approx(1.0)
    assert w[("b", 1)] == pytest.approx(-1.0)


def test_hybrid_group_mean_batch_std() -> None:
    rs = [
        make_rollout("a", [1.0], "g1"),
        make_rollout("b", [0.0], "g1"),
        make_rollout("c", [4.0], "g2"),
        make_rollout("d", [0.0], "g2"),
    ]
    w = HybridNormalizedReturn(group_size=2, eps=1e-8).compute(rs)
    # centred: (0.5, -0.5, 2, -2); batch population std = sqrt((.25+.25+4+4)/4) = sqrt(2.125)
    s = math.sqrt(2.125)
    assert [w[(x, 0)] for x in "abcd"] == pytest.approx([0.5 / s, -0.5 / s, 2 / s, -2 / s])
    wp = HybridNormalizedReturn(group_size=2, positive_only=True).compute(rs)
    assert wp[("b", 0)] == 0.0 and wp[("c", 0)] == pytest.approx(2 / s)


def test_hybrid_all_equal_rewards_gives_zero() -> None:
    rs = [make_rollout(x, [1.0], "g") for x in "ab"]
    # centred all 0, std 0 -> 0 / (0 + eps) = 0
    assert set(HybridNormalizedReturn(group_size=2).compute(rs).values()) == {0.0}


def test_constant_credit() -> None:
    w = ConstantCredit(value=2.5).compute([make_rollout("a", [0.0, 1.0])])
    assert w == {("a", 0): 2.5, ("a", 1): 2.5}


def test_missing_group_id_names_rollout_and_fix() -> None:
    with pytest.raises(ValueError, match=r"Rollout x has no group_id.*group_size=1"):
        GroupNormalizedReturn(group_size=2).compute([make_rollout("x", [1.0])])


def test_group_size_one_without_group_id_is_allowed() -> None:
    w = GroupNormalizedReturn(group_size=1).compute([make_rollout("x", [1.0])])
    assert w == {("x", 0): 0.0}


@pytest.mark.parametrize("cls", [GroupNormalizedReturn, HybridNormalizedReturn])
def test_wrong_group_size_raises(cls) -> None:
    rs = [make_rollout("a", [1.0], "g"), make_rollout("b", [0.0], "g")]
    with pytest.raises(ValueError, match=r"group 'g' has 2 rollouts.*group_size=3"):
        cls(group_size=3).compute(rs)


def test_invalid_configs() -> None:
    with pytest.raises(ValueError, match="gamma"):
        MonteCarloReturn(gamma=1.5)
    with pytest.raises(ValueError, match="group_size"):
        GroupNormalizedReturn(group_size=0)
    with pytest.raises(ValueError, match="eps"):
        HybridNormalizedReturn(group_size=2, eps=0.0)
