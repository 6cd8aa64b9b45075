"""Per-step credit (the assigners' ``gamma``), worked by hand: a format penalty at step 1
weighs steps 0 and 1 only, and the group and batch statistics stay over one episode return
per rollout, in one call and across the credit worker / learner split."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from libludic.saw import PendingBatchStage
from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.training.credit_assignment import (
    GroupNormalizedReturn,
    HybridNormalizedReturn,
    MonteCarloReturn,
    NormalizedReturn,
)
from libludic.training.filters import drop_incomplete_completions
from libludic.training.normalization import NormConfig
from libludic.training.presets import make_grpo, make_scalerl
from tests.fakes import make_item, make_rollout

EPS = 1e-5  # NormConfig's default

# One group g of three 3-step episodes:
#   a = (0, -0.5, 1)   a format penalty at step 1, then the final reward
#   b = (0,  0,   0)   no penalty, no reward
#   c = (0,  0,   1)   no penalty, the final reward
# G_t = r_t + gamma G_{t+1}:
#   gamma 1:   G_a = (0.5, 0.5, 1)        G_b = (0, 0, 0)   G_c = (1, 1, 1)
#   gamma 0.9: G_a,2 = 1, G_a,1 = -0.5 + 0.9 * 1 = 0.4, G_a,0 = 0 + 0.9 * 0.4 = 0.36
#              G_c,2 = 1, G_c,1 = 0.9,                 G_c,0 = 0.81;          G_b = 0
# episode returns e = G_0: (0.5, 0, 1) at gamma 1, mean 0.5; (0.36, 0, 0.81) at 0.9, mean 0.39
REWARDS = {"a": [0.0, -0.5, 1.0], "b": [0.0, 0.0, 0.0], "c": [0.0, 0.0, 1.0]}


def group_g() -> list[Any]:
    return [make_rollout(rid, rw, "g") for rid, rw in REWARDS.items()]


def per_step(w: dict[tuple[str, int], float], rollouts: list[Any]) -> dict[str, list[float]]:
    return {r.id: [w[(r.id, s.index)] for s in r.steps] for r in rollouts}


def test_monte_carlo_per_step_returns_and_none_is_the_total() -> None:
    rs = group_g()
    assert per_step(MonteCarloReturn(gamma=0.9).compute(rs), rs) == {
        "a": pytest.approx([0.36, 0.4, 1.0]),
        "b": [0.0, 0.0, 0.0],
        "c": pytest.approx([0.81, 0.9, 1.0]),
    }
    # gamma 1: reward-to-go; gamma None: R_a = 0 - 0.5 + 1 = 0.5 at every step
    assert per_step(MonteCarloReturn().compute(rs), rs)["a"] == pytest.approx([0.5, 0.5, 1.0])
    assert per_step(MonteCarloReturn(gamma=None).compute(rs), rs)["a"] == [0.5, 0.5, 0.5]


def test_grpo_gamma_one_penalty_lowers_only_the_steps_up_to_it() -> None:
    rs = group_g()
    # A_{i,t} = G_{i,t} - mean(e) = G_{i,t} - 0.5
    #   a: (0.5 - 0.5, 0.5 - 0.5, 1 - 0.5) = (0, 0, 0.5);  b: -0.5;  c: +0.5
    # a's last step, after the penalty, is weighed like c's; its first two less
    got = per_step(GroupNormalizedReturn(3, gamma=1.0).compute(rs), rs)
    assert got == {"a": pytest.approx([0.0, 0.0, 0.5]), "b": [-0.5] * 3, "c": [0.5] * 3}
    # gamma None (the default, before): every step of a gets R_a - 0.5 = 0
    old = per_step(GroupNormalizedReturn(3).compute(rs), rs)
    assert old == {"a": [0.0] * 3, "b": [-0.5] * 3, "c": [0.5] * 3}


def test_grpo_gamma_09_and_its_std_and_positive_only() -> None:
    rs = group_g()
    # A = G - 0.39: a (0.36 - 0.39, 0.4 - 0.39, 1 - 0.39) = (-0.03, 0.01, 0.61)
    #               b -0.39;  c (0.81 - 0.39, 0.9 - 0.39, 1 - 0.39) = (0.42, 0.51, 0.61)
    want = {"a": [-0.03, 0.01, 0.61], "b": [-0.39] * 3, "c": [0.42, 0.51, 0.61]}
    got = per_step(GroupNormalizedReturn(3, gamma=0.9).compute(rs), rs)
    assert got == {k: pytest.approx(v) for k, v in want.items()}
    # population std of e - mean = (-0.03, -0.39, 0.42):
    #   sqrt((0.0009 + 0.1521 + 0.1764) / 3) = sqrt(0.1098) = 0.331361
    s = math.sqrt(0.1098)
    got = per_step(GroupNormalizedReturn(3, normalize_adv=True, gamma=0.9).compute(rs), rs)
    assert got == {k: pytest.approx([x / s for x in v]) for k, v in want.items()}
    assert got["a"] == pytest.approx([-0.090536, 0.030179, 1.840894], abs=1e-6)
    # positive_only: max(A, 0) per step, a's first step only is clipped
    got = per_step(GroupNormalizedReturn(3, positive_only=True, gamma=0.9).compute(rs), rs)
    assert got["a"] == pytest.approx([0.0, 0.01, 0.61])


def two_groups() -> list[Any]:
    # g as above, and h: d = (-0.5, 1) (a penalty at step 0, then success), e = (0,) (fails),
    #   f = (0.2,) (one step). gamma 0.9: G_d = (-0.5 + 0.9 * 1, 1) = (0.4, 1), G_e = 0,
    #   G_f = 0.2; e_h = (0.4, 0, 0.2), mean 0.2
    h = {"d": [-0.5, 1.0], "e": [0.0], "f": [0.2]}
    return [*group_g(), *(make_rollout(rid, rw, "h") for rid, rw in h.items())]


# ScaleRL at gamma 0.9: c_{i,t} = G_{i,t} - group mean of e
#   g: a (-0.03, 0.01, 0.61), b -0.39 x3, c (0.42, 0.51, 0.61)    (mean 0.39)
#   h: d (0.4 - 0.2, 1 - 0.2) = (0.2, 0.8), e -0.2, f 0            (mean 0.2)
# batch std over one c_0 per rollout (-0.03, -0.39, 0.42, 0.2, -0.2, 0): mean 0,
#   sum of squares 0.0009 + 0.1521 + 0.1764 + 0.04 + 0.04 + 0 = 0.4094 -> sqrt(0.4094 / 6)
HYBRID_C = {
    "a": [-0.03, 0.01, 0.61],
    "b": [-0.39] * 3,
    "c": [0.42, 0.51, 0.61],
    "d": [0.2, 0.8],
    "e": [-0.2],
    "f": [0.0],
}
HYBRID_STD = math.sqrt(0.4094 / 6)
HYBRID_A = {k: [c / HYBRID_STD for c in v] for k, v in HYBRID_C.items()}


def test_hybrid_gamma_09_group_centring_and_batch_std_over_episodes() -> None:
    rs = two_groups()
    assert HYBRID_STD == pytest.approx(0.261215, abs=1e-6)
    a = HybridNormalizedReturn(3, gamma=0.9)
    assert per_step(a.group_stage(rs), rs) == {k: pytest.approx(v) for k, v in HYBRID_C.items()}
    got = per_step(a.compute(rs), rs)
    assert got == {k: pytest.approx(v, rel=1e-6) for k, v in HYBRID_A.items()}
    assert got["a"] == pytest.approx([-0.114848, 0.038283, 2.335240], abs=1e-6)
    # the batch stage over items: each counts 1 / (its rollout's steps) with its episode's
    # c_0, so the std is the same; without ``episodes`` it is taken over every step's c
    stage = a.group_stage(rs)
    values = [stage[(r.id, s.index)] for r in rs for s in r.steps]
    shares = [1 / len(r.steps) for r in rs for _ in r.steps]
    episodes = [stage[(r.id, 0)] for r in rs for _ in r.steps]
    flat = [x for r in rs for x in HYBRID_A[r.id]]
    assert a.batch_stage(values, None, shares, episodes=episodes) == pytest.approx(flat, rel=1e-6)
    assert a.batch_stage(values, None, shares) != pytest.approx(flat, rel=1e-3)


def test_normalized_return_leave_one_out_then_batch_std_gamma_09() -> None:
    rs = group_g()
    # reward_norm RLOO: m_i = mean of the others' e, e = (0.36, 0, 0.81)
    #   a: m = (0 + 0.81) / 2 = 0.405 -> (0.36, 0.4, 1) - 0.405 = (-0.045, -0.005, 0.595)
    #   b: m = (0.36 + 0.81) / 2 = 0.585 -> -0.585
    #   c: m = (0.36 + 0) / 2 = 0.18 -> (0.81, 0.9, 1) - 0.18 = (0.63, 0.72, 0.82)
    # adv_norm: batch std (no centring, unbiased) over the episodes' (-0.045, -0.585, 0.63):
    #   sqrt((0.002025 + 0.342225 + 0.3969) / 2) = sqrt(0.370575) = 0.608749; + eps 1e-5
    a = NormalizedReturn(
        3,
        reward_norm=NormConfig("group", True, None),
        adv_norm=NormConfig(None, False, "batch"),
        gamma=0.9,
    )
    assert a.needs_batch_stage
    s = math.sqrt(0.370575) + EPS
    want = {"a": [-0.045, -0.005, 0.595], "b": [-0.585] * 3, "c": [0.63, 0.72, 0.82]}
    assert per_step(a.group_stage(rs), rs) == {k: pytest.approx(v) for k, v in want.items()}
    got = per_step(a.compute(rs), rs)
    assert got == {k: pytest.approx([x / s for x in v]) for k, v in want.items()}
    assert got["c"][0] == pytest.approx(1.034893, abs=1e-6)
    # gamma 1: e = (0.5, 0, 1); RLOO a: 0.5 - 0.5 = 0 -> (0, 0, 0.5), b -0.75, c +0.75;
    #   std sqrt((0 + 0.5625 + 0.5625) / 2) = 0.75 -> a (0, 0, 0.5 / 0.75), b -1, c 1
    one = NormalizedReturn(
        3,
        reward_norm=NormConfig("group", True, None),
        adv_norm=NormConfig(None, False, "batch"),
        gamma=1.0,
    )
    t = 0.75 + EPS
    assert per_step(one.compute(rs), rs) == {
        "a": pytest.approx([0.0, 0.0, 0.5 / t]),
        "b": pytest.approx([-0.75 / t] * 3),
        "c": pytest.approx([0.75 / t] * 3),
    }


ASSIGNERS = [
    lambda g: MonteCarloReturn(gamma=g),
    lambda g: GroupNormalizedReturn(3, gamma=g),
    lambda g: GroupNormalizedReturn(3, normalize_adv=True, positive_only=True, gamma=g),
    lambda g: HybridNormalizedReturn(3, gamma=g),
    lambda g: NormalizedReturn(
        3, NormConfig("group", True, "group"), NormConfig("batch", False, "batch"), gamma=g
    ),
]


@pytest.mark.parametrize("make", ASSIGNERS)
def test_gamma_one_with_a_final_reward_only_is_the_outcome_credit(make: Any) -> None:
    # G_{i,t} = r_last for every t when the last step holds the only reward: the per-step
    # returns equal R_i, the value gamma None broadcasts, so the weights are the same
    rng = random.Random(0)
    rs = [
        make_rollout(f"r{i}", [0.0] * rng.randrange(3) + [rng.choice([0.0, 0.5, 1.0])], "g")
        for i in range(3)
    ]
    rs[0].steps[-1].reward = 2.0  # not all equal
    assert make(1.0).compute(rs) == pytest.approx(make(None).compute(rs))


def test_monte_carlo_penalty_leaves_later_steps_unchanged() -> None:
    # G_t = sum_{k>=t} gamma^(k-t) r_k: a penalty at step 1 is in G_0, G_1 and not in G_2
    clean = MonteCarloReturn(gamma=0.9).compute([make_rollout("a", [0.0, 0.0, 1.0])])
    pen = MonteCarloReturn(gamma=0.9).compute([make_rollout("a", [0.0, -0.5, 1.0])])
    # G_1: -0.5 lower; G_0: 0.9 * -0.5 = -0.45 lower; G_2 unchanged
    assert [pen[("a", t)] - clean[("a", t)] for t in range(3)] == pytest.approx([-0.45, -0.5, 0])


def test_gamma_is_validated_on_every_assigner() -> None:
    makers: list[tuple[str, Callable[[Any], object]]] = [
        ("MonteCarloReturn", lambda g: MonteCarloReturn(gamma=g)),
        ("GroupNormalizedReturn", lambda g: GroupNormalizedReturn(2, gamma=g)),
        ("HybridNormalizedReturn", lambda g: HybridNormalizedReturn(2, gamma=g)),
        ("NormalizedReturn", lambda g: NormalizedReturn(2, gamma=g)),
    ]
    for name, make in makers:
        with pytest.raises(ValueError, match=rf"{name}.gamma=1.5 must be a number in \[0, 1\]"):
            make(1.5)
        with pytest.raises(ValueError, match=rf"{name}.gamma=True must be"):
            make(True)
        with pytest.raises(ValueError, match=rf"{name}.gamma=-0.1 must be"):
            make(-0.1)


# ---- the split: credit's group stage, the learner's batch stage ---------------------------


def test_scalerl_per_step_survives_the_split_with_step_0_filtered_out() -> None:
    """Credit writes each group alone (defer_batch_stage) and the learner finishes the items
    it trains on: the weights of one library call and of the hand computation above, with
    a's step 0, the step holding its episode value c_0 = -0.03, dropped by a filter: a's
    other items carry that value in meta."""
    rs = two_groups()
    rs[0].steps[0].info["finish_reason"] = "length"  # a:0 goes, drop_incomplete_completions
    keep = drop_incomplete_completions()
    algo = AlgorithmSpec.from_mapping(
        {"name": "scalerl", "group_size": 3, "kwargs": {"gamma": 0.9}}
    ).build()
    pending = algo.to_saw_items(rs[:3], keep, defer_batch_stage=True)
    pending += algo.to_saw_items(rs[3:], keep, defer_batch_stage=True)
    stamp = {it.item_id: it.pending for it in pending}
    assert "a:0" not in stamp and stamp["a:1"].rollout_items == 2
    assert stamp["a:1"].episode_weight == stamp["a:2"].episode_weight == pytest.approx(-0.03)
    assert stamp["d:1"].episode_weight == pytest.approx(0.2)
    assert stamp["b:1"].episode_weight is None  # b's steps all weigh its c_0: nothing to add
    assert stamp["d:0"].episode_weight is None  # the first step's weight is its c_0
    done = {it.item_id: it for it in algo.apply_batch_stage(pending)}
    library = {it.item_id: it.weight for it in algo.to_saw_items(rs, keep)}
    assert (
        done.keys()
        == library.keys()
        == {f"{r.id}:{s.index}" for r in rs for s in r.steps} - {"a:0"}
    )
    for k, it in done.items():
        rid, t = k.split(":")
        assert it.weight == pytest.approx(HYBRID_A[rid][int(t)], rel=1e-6), k
        assert library[k] == pytest.approx(it.weight, rel=1e-9), k
        assert it.pending is None
    assert done["a:2"].meta["group_weight"] == pytest.approx(0.61)
    # without pending.episode_weight the learner would take the std over the items' c
    bare = [
        dataclasses.replace(it, pending=dataclasses.replace(it.pending, episode_weight=None))
        for it in pending
    ]
    assert algo.apply_batch_stage(bare)[0].weight != pytest.approx(HYBRID_A["a"][1], rel=1e-3)


def test_grpo_defaults_write_what_they_wrote_before() -> None:
    # no gamma: every step of a weighs R_a - mean(R) = 0.5 - 0.5 = 0; nothing new in meta
    rs = group_g()
    items = make_grpo(group_size=3).to_saw_items(rs)
    assert {it.item_id: it.weight for it in items} == {
        f"{r}:{t}": w for r, w in (("a", 0.0), ("b", -0.5), ("c", 0.5)) for t in range(3)
    }
    pending = make_scalerl(group_size=3).to_saw_items(rs, defer_batch_stage=True)
    assert all(it.pending is not None and it.pending.episode_weight is None for it in pending)


# ---- presets ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "cispo", "gspo", "dr_grpo", "scalerl"])
def test_every_grouped_preset_takes_gamma_default_none(name: str) -> None:
    def credit(section: dict[str, Any]) -> Any:
        return AlgorithmSpec.from_mapping(section).build().credit_assigner

    assert credit({"name": name}).gamma is None
    assert credit({"name": name, "kwargs": {"gamma": 0.9}}).gamma == 0.9
    # with reward_norm the preset's NormalizedReturn gets it too
    rloo = {"mean_level": "group", "mean_leave1out": True, "std_level": None}
    ca = credit({"name": name, "kwargs": {"gamma": 0.9, "reward_norm": rloo}})
    assert isinstance(ca, NormalizedReturn) and ca.gamma == 0.9


def test_reinforce_and_custom_gamma() -> None:
    def build(name: str, kwargs: dict[str, Any]) -> Any:
        return AlgorithmSpec.from_mapping({"name": name, "kwargs": kwargs}).build()

    assert build("reinforce", {}).credit_assigner.gamma == 1.0
    assert build("reinforce", {"gamma": 0.9}).credit_assigner.gamma == 0.9
    assert build("reinforce", {"gamma": None}).credit_assigner.gamma is None
    loss = {"kind": "ReinforceLoss"}
    norm = {"kind": "NormalizedReturn", "kwargs": {"reward_norm": {"mean_level": "group"}}}
    ca = build("custom", {"credit": norm, "loss": loss, "gamma": 0.9}).credit_assigner
    assert isinstance(ca, NormalizedReturn) and ca.gamma == 0.9 and ca.group_size == 8
    assert build("custom", {"credit": norm, "loss": loss}).credit_assigner.gamma is None
    same = {"kind": "GroupNormalizedReturn", "kwargs": {"gamma": 0.9}}
    assert (
        build("custom", {"credit": same, "loss": loss, "gamma": 0.9}).credit_assigner.gamma == 0.9
    )
    with pytest.raises(ValueError, match=r"gamma=0.5 and .*credit.kwargs.gamma=0.9 differ"):
        build("custom", {"credit": same, "loss": loss, "gamma": 0.5})
    with pytest.raises(ValueError, match="ConstantCredit takes no gamma"):
        build("custom", {"credit": {"kind": "ConstantCredit"}, "loss": loss, "gamma": 0.9})
    with pytest.raises(ValueError, match=r"algorithm 'grpo'.*GroupNormalizedReturn.gamma=2"):
        build("grpo", {"gamma": 2})


def test_item_problem_names_a_bad_episode_weight() -> None:
    it = make_item(3, 2)
    it.pending = PendingBatchStage(2, "x")  # type: ignore[arg-type]
    assert "pending_batch_stage.episode_weight='x' is not a finite number" in (
        make_scalerl().item_problem(it) or ""
    )
    it.pending = PendingBatchStage(2, float("nan"))
    assert "not a finite number" in (make_scalerl().item_problem(it) or "")
    it.pending = PendingBatchStage(2, -0.25)
    assert make_scalerl().item_problem(it) is None


def test_a_two_stage_assigner_is_found_by_its_protocol_and_a_partial_one_is_refused() -> None:
    from libludic.training.credit_assignment import (
        GroupNormalizedReturn,
        HybridNormalizedReturn,
        NormalizedReturn,
        StagedCreditAssigner,
        staged,
    )
    from libludic.training.normalization import NormConfig

    hybrid = HybridNormalizedReturn(group_size=2)
    assert staged(hybrid) is hybrid and isinstance(hybrid, StagedCreditAssigner)
    batch_std = NormalizedReturn(
        group_size=2, adv_norm=NormConfig(mean_level="group", std_level="batch")
    )
    assert staged(batch_std) is batch_std
    group_only = NormalizedReturn(
        group_size=2, adv_norm=NormConfig(mean_level="group", std_level="group")
    )
    assert staged(group_only) is None  # runs as a plain compute
    assert staged(GroupNormalizedReturn(group_size=2)) is None

    class Partial:
        def compute(self, rollouts):
            return {}

        def batch_stage(self, values, all_sum=None, weights=None, episodes=None):
            return list(values)

    with pytest.raises(
        TypeError, match="Partial has batch_stage but no needs_batch_stage or group_stage"
    ):
        staged(Partial())
