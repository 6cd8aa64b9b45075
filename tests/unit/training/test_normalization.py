"""Reward / advantage normalisation (AReaL's NormConfig as reward_norm / adv_norm), worked by
hand; ScaleRL's batch std over one value per rollout in the library and the service path."""

from __future__ import annotations

import math

import pytest

from libludic.training.algorithm import RLAlgorithm
from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.training.credit_assignment import (
    GroupNormalizedReturn,
    HybridNormalizedReturn,
    NormalizedReturn,
)
from libludic.training.filters import drop_incomplete_completions
from libludic.training.normalization import NormConfig
from libludic.training.presets import make_scalerl
from tests.fakes import make_rollout

EPS = 1e-5  # AReaL's default


def spec(section: dict) -> RLAlgorithm:
    return AlgorithmSpec.from_mapping(section).build()


def two_groups() -> list:
    # g1 rewards (0, 0, 0, 1), g2 (0, 0, 1, 1)
    return [
        make_rollout(f"{g}{i}", [r], g)
        for g, rs in (("g", [0, 0, 0, 1]), ("h", [0, 0, 1, 1]))
        for i, r in enumerate(rs)
    ]


def weights(assigner, rollouts) -> list[float]:
    w = assigner.compute(rollouts)
    return [w[(r.id, 0)] for r in rollouts]


def norm(**kw) -> NormConfig:
    return NormConfig(**kw)


def test_group_mean_without_std_is_grpos_centring() -> None:
    # g1 mean 0.25 -> (-0.25 x3, 0.75); g2 mean 0.5 -> (-0.5, -0.5, 0.5, 0.5)
    a = NormalizedReturn(4, reward_norm=norm(mean_level="group", std_level=None))
    assert weights(a, two_groups()) == pytest.approx([-0.25] * 3 + [0.75, -0.5, -0.5, 0.5, 0.5])
    assert not a.needs_batch_stage


def test_leave_one_out_mean() -> None:
    # g1: a zero's others are (0, 0, 1) -> mean 1/3 -> -1/3; the one's others (0, 0, 0) -> 1
    # g2: a zero's others (0, 1, 1) -> 2/3 -> -2/3; a one's others (0, 0, 1) -> 1/3 -> 2/3
    a = NormalizedReturn(
        4, reward_norm=norm(mean_level="group", mean_leave1out=True, std_level=None)
    )
    want = [-1 / 3] * 3 + [1.0, -2 / 3, -2 / 3, 2 / 3, 2 / 3]
    assert weights(a, two_groups()) == pytest.approx(want)


def test_group_std_unbiased_and_biased() -> None:
    # g1 centred (-0.25 x3, 0.75): sum c^2 = 3 * 0.0625 + 0.5625 = 0.75
    #   unbiased std sqrt(0.75 / 3) = 0.5;  biased sqrt(0.75 / 4) = sqrt(0.1875)
    rs = two_groups()[:4]
    unb = NormalizedReturn(4, reward_norm=norm(mean_level="group", std_level="group"))
    assert weights(unb, rs) == pytest.approx([-0.25 / (0.5 + EPS)] * 3 + [0.75 / (0.5 + EPS)])
    b = NormalizedReturn(
        4, reward_norm=norm(mean_level="group", std_level="group", std_unbiased=False, eps=1e-8)
    )
    s = math.sqrt(0.1875)
    assert weights(b, rs) == pytest.approx([-0.25 / s] * 3 + [0.75 / s])
    # the same as GRPO's normalize_adv (population std, eps 1e-8)
    assert weights(b, rs) == pytest.approx(
        weights(GroupNormalizedReturn(4, normalize_adv=True), rs)
    )


def test_batch_mean_and_std_areal_defaults() -> None:
    # all 8: mean 3/8; sum (x - 3/8)^2 = 5 * 0.140625 + 3 * 0.390625 = 1.875
    #   unbiased std sqrt(1.875 / 7) = 0.5175492
    a = NormalizedReturn(4, reward_norm=NormConfig())
    assert a.needs_batch_stage
    s = math.sqrt(1.875 / 7)
    want = [(x - 0.375) / (s + EPS) for x in (0, 0, 0, 1, 0, 0, 1, 1)]
    assert weights(a, two_groups()) == pytest.approx(want)


def test_group_mean_then_batch_std_and_the_same_as_a_chain() -> None:
    # centred c = (-0.25 x3, 0.75, -0.5, -0.5, 0.5, 0.5): sum c^2 = 0.75 + 1.0 = 1.75
    #   unbiased batch std around the group means: sqrt(1.75 / 7) = 0.5
    want = [c / (0.5 + EPS) for c in (-0.25, -0.25, -0.25, 0.75, -0.5, -0.5, 0.5, 0.5)]
    one = NormalizedReturn(4, reward_norm=norm(mean_level="group", std_level="batch"))
    assert weights(one, two_groups()) == pytest.approx(want)
    # reward_norm centres per group, adv_norm whitens over the batch (c's batch mean is 0)
    chain = NormalizedReturn(
        4, reward_norm=norm(mean_level="group", std_level=None), adv_norm=NormConfig()
    )
    assert weights(chain, two_groups()) == pytest.approx(want)


def test_edge_cases_of_one_value() -> None:
    # a group of one: leave-one-out mean over no other value is 0, unbiased std over 1 value is 1
    a = NormalizedReturn(
        1, reward_norm=norm(mean_level="group", mean_leave1out=True, std_level="group")
    )
    assert weights(a, [make_rollout("x", [3.0])]) == pytest.approx([3.0 / (1 + EPS)])
    pos = NormalizedReturn(
        4, reward_norm=norm(mean_level="group", std_level=None), positive_only=True
    )
    assert weights(pos, two_groups()[:4]) == pytest.approx([0.0] * 3 + [0.75])


def test_norm_config_errors_name_the_key_and_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"reward_norm.group_size=4: a group is the rollouts sharing meta.group_id"
    ):
        NormConfig.parse({"mean_level": "group", "group_size": 4}, "reward_norm")
    with pytest.raises(ValueError, match=r"adv_norm keys \['std'\] are unknown"):
        NormConfig.parse({"std": "batch"}, "adv_norm")
    with pytest.raises(
        ValueError, match=r"adv_norm.mean_level='token'; use 'batch', 'group' or null"
    ):
        NormConfig.parse({"mean_level": "token"}, "adv_norm")
    with pytest.raises(ValueError, match="reward_norm.eps=0 must be a number > 0"):
        NormConfig.parse({"eps": 0}, "reward_norm")
    assert NormConfig.parse({"std_level": "None"}, "x").std_level is None  # AReaL's spelling
    with pytest.raises(
        ValueError,
        match=r"reward_norm.std_level='group' comes after reward_norm.mean_level='batch'",
    ):
        NormalizedReturn(4, reward_norm=norm(mean_level="batch", std_level="group"))
    with pytest.raises(
        ValueError, match=r"adv_norm.mean_level='group' comes after reward_norm.std_level='batch'"
    ):
        NormalizedReturn(
            4, reward_norm=norm(mean_level=None), adv_norm=norm(mean_level="group", std_level=None)
        )


@pytest.mark.parametrize(
    "name,builtin",
    [
        ("grpo", GroupNormalizedReturn),
        ("cispo", GroupNormalizedReturn),
        ("gspo", GroupNormalizedReturn),
        ("dr_grpo", GroupNormalizedReturn),
        ("scalerl", HybridNormalizedReturn),
    ],
)
def test_presets_take_reward_norm_and_adv_norm_from_the_algorithm_section(name, builtin) -> None:
    assert isinstance(spec({"name": name}).credit_assigner, builtin)  # unset: as before
    rloo = {"mean_level": "group", "mean_leave1out": True, "std_level": None}
    algo = spec(
        {"name": name, "group_size": 4, "kwargs": {"reward_norm": rloo, "dynamic_sampling": False}}
    )
    assert isinstance(algo.credit_assigner, NormalizedReturn)
    assert algo.credit_assigner.reward_norm == NormConfig("group", True, None)
    items = algo.to_saw_items(two_groups())
    assert [it.weight for it in items] == pytest.approx(
        [-1 / 3] * 3 + [1.0, -2 / 3, -2 / 3, 2 / 3, 2 / 3]
    )
    # adv_norm alone keeps the preset's own normalisation first: a no-op adv_norm changes nothing
    noop = {"mean_level": None, "std_level": None}
    same = spec(
        {"name": name, "group_size": 4, "kwargs": {"adv_norm": noop, "dynamic_sampling": False}}
    )
    assert isinstance(same.credit_assigner, NormalizedReturn)
    plain = spec({"name": name, "group_size": 4, "kwargs": {"dynamic_sampling": False}})
    assert [it.weight for it in same.to_saw_items(two_groups())] == pytest.approx(
        [it.weight for it in plain.to_saw_items(two_groups())], rel=1e-6
    )


def test_preset_specific_norm_errors() -> None:
    with pytest.raises(ValueError, match="grpo: normalize_adv=True and reward_norm both set"):
        spec(
            {
                "name": "grpo",
                "kwargs": {"normalize_adv": True, "reward_norm": {"mean_level": "group"}},
            }
        )
    with pytest.raises(ValueError, match="reward_norm.std_level must be null in dr_grpo"):
        spec({"name": "dr_grpo", "kwargs": {"reward_norm": {"mean_level": "group"}}})
    with pytest.raises(ValueError, match="adv_norm.std_level must be null in dr_grpo"):
        spec({"name": "dr_grpo", "kwargs": {"adv_norm": {}}})
    assert spec({"name": "gspo"}).credit_assigner.normalize_adv  # unset: True for gspo
    assert not spec(
        {"name": "gspo", "kwargs": {"normalize_adv": False}}
    ).credit_assigner.normalize_adv


def test_batch_level_adv_norm_is_finished_by_the_learner_in_the_services() -> None:
    algo = spec({"name": "grpo", "group_size": 4, "kwargs": {"adv_norm": {}}})
    rs = two_groups()
    library = algo.to_saw_items(rs)
    service = algo.to_saw_items(rs[:4], defer_batch_stage=True) + algo.to_saw_items(
        rs[4:], defer_batch_stage=True
    )
    assert [it.weight for it in service] == pytest.approx(
        [-0.25] * 3 + [0.75, -0.5, -0.5, 0.5, 0.5]
    )
    done = algo.apply_batch_stage(service)
    # the numbers of test_group_mean_then_batch_std_and_the_same_as_a_chain
    want = [c / (0.5 + EPS) for c in (-0.25, -0.25, -0.25, 0.75, -0.5, -0.5, 0.5, 0.5)]
    assert [it.weight for it in done] == pytest.approx(want)
    assert [it.weight for it in library] == pytest.approx(want)


# ScaleRL with multi-step rollouts: group g: a (1 step, reward 1), b (3 steps, 0 + 0 + 0);
# group h: c (2 steps, 1 + 2 = 3), d (1 step, 1). Centred per rollout: a +0.5, b -0.5,
# c +1, d -1. One value per rollout: std = sqrt((0.25 + 0.25 + 1 + 1) / 4) = sqrt(0.625).
# Over items (one per step: a, b x3, c x2, d) it would be sqrt((0.25 + 3 * 0.25 + 2 * 1 + 1)
# / 7) = sqrt(4 / 7): a 0.661 instead of 0.632.
STD_ROLLOUTS = math.sqrt(0.625)
STD_ITEMS = math.sqrt(4 / 7)


def multi_step() -> list:
    b = make_rollout("b", [0.0, 0.0, 0.0], "g")
    b.steps[1].info["finish_reason"] = "length"  # dropped by drop_incomplete_completions
    return [
        make_rollout("a", [1.0], "g"),
        b,
        make_rollout("c", [1.0, 2.0], "h"),
        make_rollout("d", [1.0], "h"),
    ]


def by_item(items) -> dict[str, float]:
    return {it.item_id: it.weight for it in items}


@pytest.mark.parametrize("keep", [None, drop_incomplete_completions()])
def test_scalerl_batch_std_is_over_rollouts_in_the_library_and_the_service_path(keep) -> None:
    algo = make_scalerl(group_size=2, dynamic_sampling=False)
    rs = multi_step()
    library = by_item(algo.to_saw_items(rs, keep))
    pending = algo.to_saw_items(rs[:2], keep, defer_batch_stage=True) + algo.to_saw_items(
        rs[2:], keep, defer_batch_stage=True
    )
    service = by_item(algo.apply_batch_stage(pending))
    assert library.keys() == service.keys()
    assert ("b:1" in library) == (keep is None)
    for k in library:
        assert service[k] == pytest.approx(library[k], rel=1e-9)
    c = {"a": 0.5, "b": -0.5, "c": 1.0, "d": -1.0}
    assert library == pytest.approx(
        {k: c[k.split(":")[0]] / STD_ROLLOUTS for k in library}, rel=1e-6
    )
    assert library["a:0"] == pytest.approx(0.632456, rel=1e-5)
    assert 0.5 / STD_ITEMS == pytest.approx(0.661438, rel=1e-5)  # what counting items would give
    # HybridNormalizedReturn.compute (no filter) agrees: one value per rollout
    w = HybridNormalizedReturn(group_size=2).compute(rs)
    assert w[("b", 2)] == pytest.approx(-0.5 / STD_ROLLOUTS) and w[("c", 1)] == pytest.approx(
        1 / STD_ROLLOUTS
    )
