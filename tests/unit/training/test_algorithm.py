"""Algorithm presets, sample filters and the rollout -> SAWItem path."""

from __future__ import annotations

import re
from typing import Any

import pytest

from libludic.saw import PendingBatchStage
from libludic.training.algorithm import CreditStats, RLAlgorithm
from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.training.credit_assignment import (
    ConstantCredit,
    GroupNormalizedReturn,
    HybridNormalizedReturn,
    MonteCarloReturn,
)
from libludic.training.filters import (
    combine,
    drop_incomplete_completions,
    drop_parse_errors,
    drop_truncated,
    drop_zero_variance_groups,
)
from libludic.training.loss import (
    CISPOLoss,
    CompositeLoss,
    GSPOLoss,
    MaskedCausalLMCrossEntropyLoss,
    OffPolicyCorrection,
    ReinforceLoss,
    TokenClippedSurrogateLoss,
    TokenKLLoss,
)
from libludic.training.presets import (
    make_cispo,
    make_dr_grpo,
    make_grpo,
    make_gspo,
    make_reinforce,
    make_scalerl,
    make_sft,
)
from tests.fakes import make_item, make_rollout


def test_preset_defaults() -> None:
    r = make_reinforce()
    assert isinstance(r.credit_assigner, MonteCarloReturn) and r.credit_assigner.gamma == 1.0
    assert isinstance(r.loss, ReinforceLoss) and r.preprocess is None

    g = make_grpo()
    assert isinstance(g.credit_assigner, GroupNormalizedReturn)
    assert (g.credit_assigner.group_size, g.credit_assigner.normalize_adv) == (8, False)
    assert isinstance(g.loss, TokenClippedSurrogateLoss) and g.loss.eps_clip == 0.2
    assert g.needs_actor_logprobs

    s = make_sft()
    assert isinstance(s.credit_assigner, ConstantCredit) and s.credit_assigner.value == 1.0
    assert isinstance(s.loss, MaskedCausalLMCrossEntropyLoss) and not s.needs_actor_logprobs

    sc = make_scalerl()
    assert (
        isinstance(sc.credit_assigner, HybridNormalizedReturn)
        and sc.credit_assigner.group_size == 8
    )
    assert isinstance(sc.loss, CISPOLoss) and sc.preprocess is drop_zero_variance_groups
    assert make_scalerl(filter_zvp=False).preprocess is None

    c = make_cispo()
    assert (
        isinstance(c.credit_assigner, GroupNormalizedReturn) and c.credit_assigner.group_size == 8
    )
    assert isinstance(c.loss, CISPOLoss)
    ck = make_cispo(kl_coeff=0.05)
    assert isinstance(ck.loss, CompositeLoss)
    assert isinstance(ck.loss.terms[1].loss, TokenKLLoss) and ck.loss.terms[1].coeff == 0.05
    assert ck.needs_actor_logprobs
    with pytest.raises(ValueError, match="kl_coeff"):
        make_grpo(kl_coeff=-1.0)


def test_presets_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        make_grpo(4)  # type: ignore[misc]


def test_to_saw_items_credits_then_filters() -> None:
    rs = [
        make_rollout("a", [1.0], "g", logprobs=[-0.1, -0.2]),
        make_rollout("b", [0.0], "g", logprobs=[-0.1, -0.2], info={"finish_reason": "length"}),
    ]
    algo = make_grpo(group_size=2)
    items = algo.to_saw_items(rs)
    # group mean 0.5 -> +0.5 / -0.5
    assert [(i.item_id, i.weight) for i in items] == [("a:0", 0.5), ("b:0", -0.5)]
    kept = algo.to_saw_items(rs, drop_incomplete_completions())
    # the filter runs after credit: "a" keeps the advantage computed with "b" in its group
    assert [(i.item_id, i.weight) for i in kept] == [("a:0", 0.5)]


def test_scalerl_drops_zero_variance_groups() -> None:
    rs = [
        make_rollout(f"{g}{i}", [r], g)
        for g, rewards in (("x", [1.0, 1.0]), ("y", [1.0, 0.0]))
        for i, r in enumerate(rewards)
    ]
    items = make_scalerl(group_size=2).to_saw_items(rs)
    assert sorted(i.meta["group_id"] for i in items) == ["y", "y"]
    assert make_scalerl(group_size=2).to_saw_items(rs[:2]) == []


def test_filters() -> None:
    it = make_item(2, 1)
    assert drop_truncated()(it) and drop_incomplete_completions()(it) and drop_parse_errors()(it)
    it.meta.update(truncated=True)
    assert not drop_truncated()(it)
    it2 = make_item(2, 1)
    it2.meta.update(finish_reason="length")
    assert not drop_incomplete_completions()(it2) and drop_parse_errors()(it2)
    it3 = make_item(2, 1)
    it3.meta.update(parse_error="no <answer> tag")
    assert not drop_parse_errors()(it3)
    f = combine(drop_truncated(), drop_incomplete_completions(), drop_parse_errors())
    assert [f(x) for x in (make_item(2, 1), it, it2, it3)] == [True, False, False, False]
    assert combine()(it)


def test_custom_composition() -> None:
    algo = RLAlgorithm("mine", ConstantCredit(2.0), ReinforceLoss())
    items = algo.to_saw_items([make_rollout("a", [0.0, 1.0])])
    assert [i.weight for i in items] == [2.0, 2.0]


def spec(section: dict) -> RLAlgorithm:
    """The algorithm a run config's ``algorithm:`` section builds."""
    return AlgorithmSpec.from_mapping(section).build()


@pytest.mark.parametrize("name", ["grpo", "cispo", "scalerl"])
def test_mismatch_correction_from_the_algorithm_section(name) -> None:
    algo = spec(
        {
            "name": name,
            "group_size": 4,
            "kwargs": {
                "mismatch_correction": "mis",
                "mismatch_level": "sequence",
                "mismatch_cap": 3.0,
            },
        }
    )
    assert algo.loss.off_policy == OffPolicyCorrection("mis", "sequence", 3.0)
    assert spec({"name": name}).loss.off_policy == OffPolicyCorrection(None, "token", 2.0)
    with pytest.raises(
        ValueError, match=rf"algorithm '{name}' with kwargs .*mismatch_correction='ois'"
    ):
        spec({"name": name, "kwargs": {"mismatch_correction": "ois"}})


@pytest.mark.parametrize("name", ["grpo", "cispo", "scalerl"])
def test_decoupled_ppo_from_the_algorithm_section(name) -> None:
    algo = spec({"name": name, "kwargs": {"use_decoupled_loss": True, "behav_imp_weight_cap": 5.0}})
    assert algo.loss.off_policy == OffPolicyCorrection(
        use_decoupled_loss=True, behav_imp_weight_cap=5.0
    )
    assert algo.needs_prox_logprobs
    assert spec({"name": name, "kwargs": {"recompute_logprob": True}}).needs_prox_logprobs
    assert not spec({"name": name}).needs_prox_logprobs
    with pytest.raises(ValueError, match=rf"algorithm '{name}'.*needs use_decoupled_loss=True"):
        spec({"name": name, "kwargs": {"behav_imp_weight_cap": 5.0}})


def test_decoupled_ppo_with_kl_still_asks_for_prox_logprobs() -> None:
    algo = spec({"name": "grpo", "kwargs": {"use_decoupled_loss": True, "kl_coeff": 0.1}})
    assert isinstance(algo.loss, CompositeLoss)
    assert algo.needs_prox_logprobs and algo.needs_ref_logprobs


def test_gspo_and_dr_grpo_presets() -> None:
    g = make_gspo()
    assert isinstance(g.loss, GSPOLoss) and g.needs_actor_logprobs
    assert (g.loss.eps_clip, g.loss.eps_clip_higher, g.loss.aggregation) == (
        3e-4,
        4e-4,
        "seq-mean-token-mean",
    )
    assert isinstance(g.credit_assigner, GroupNormalizedReturn) and g.credit_assigner.normalize_adv
    d = make_dr_grpo()
    assert isinstance(d.loss, TokenClippedSurrogateLoss) and d.loss.eps_clip == 0.2
    assert (d.loss.aggregation, d.loss.max_new_tokens) == ("seq-mean-token-sum-norm", 1024)
    assert (
        isinstance(d.credit_assigner, GroupNormalizedReturn) and not d.credit_assigner.normalize_adv
    )
    assert isinstance(make_dr_grpo(kl_coeff=0.1).loss, CompositeLoss)


def test_dr_grpo_credit_is_mean_centred_and_gspo_divides_by_the_std() -> None:
    rs = [
        make_rollout(f"r{i}", [r], "g", logprobs=[-0.1, -0.2])
        for i, r in enumerate([1.0, 0.0, 0.0, 0.0])
    ]
    # mean 0.25: Dr. GRPO A = R - mean = 0.75, -0.25 x3
    assert [i.weight for i in make_dr_grpo(group_size=4).to_saw_items(rs)] == pytest.approx(
        [0.75] + [-0.25] * 3
    )
    # GSPO (the paper's GRPO advantage): std = sqrt((0.5625 + 3 * 0.0625) / 4) = sqrt(0.1875)
    std = 0.1875**0.5
    want = [0.75 / std] + [-0.25 / std] * 3
    assert [i.weight for i in make_gspo(group_size=4).to_saw_items(rs)] == pytest.approx(
        want, rel=1e-6
    )


def test_gspo_and_dr_grpo_from_the_algorithm_section() -> None:
    g = spec(
        {
            "name": "gspo",
            "group_size": 4,
            "kwargs": {
                "eps_clip": 1e-3,
                "eps_clip_higher": 2e-3,
                "aggregation": "token-mean",
                "normalize_adv": False,
                "mismatch_correction": "tis",
                "mismatch_level": "sequence",
            },
        }
    )
    assert (
        g.name == "gspo"
        and g.credit_assigner.group_size == 4
        and not g.credit_assigner.normalize_adv
    )
    assert (g.loss.eps_clip, g.loss.eps_clip_higher, g.loss.aggregation) == (
        1e-3,
        2e-3,
        "token-mean",
    )
    assert g.loss.off_policy == OffPolicyCorrection("tis", "sequence")
    d = spec(
        {
            "name": "dr_grpo",
            "group_size": 4,
            "kwargs": {"max_new_tokens": 4096, "use_decoupled_loss": True},
        }
    )
    assert d.name == "dr_grpo" and (d.loss.aggregation, d.loss.max_new_tokens) == (
        "seq-mean-token-sum-norm",
        4096,
    )
    assert d.needs_prox_logprobs
    with pytest.raises(ValueError, match=r"\['normalize_adv'\] are not arguments of make_dr_grpo"):
        spec({"name": "dr_grpo", "kwargs": {"normalize_adv": True}})
    with pytest.raises(ValueError, match="algorithm 'dr_grpo'.*needs max_new_tokens"):
        spec({"name": "dr_grpo", "kwargs": {"max_new_tokens": None}})


@pytest.mark.parametrize("name", ["reinforce", "grpo", "cispo", "scalerl", "gspo", "dr_grpo"])
def test_aggregation_from_the_algorithm_section(name) -> None:
    algo = spec(
        {"name": name, "kwargs": {"aggregation": "seq-mean-token-sum-norm", "max_new_tokens": 512}}
    )
    loss = algo.loss
    assert (loss.aggregation, loss.max_new_tokens) == ("seq-mean-token-sum-norm", 512)
    assert (
        spec({"name": name, "kwargs": {"aggregation": "seq-mean-token-sum"}}).loss.aggregation
        == "seq-mean-token-sum"
    )
    assert (
        spec({"name": name, "kwargs": {"aggregation": "token"}}).loss.aggregation == "token"
    )  # old name
    with pytest.raises(ValueError, match=rf"algorithm '{name}'.*aggregation='mean'"):
        spec({"name": name, "kwargs": {"aggregation": "mean"}})


def zero_variance_rollouts() -> list:
    """Groups of 2: x (1, 1) and z (0.5, 0.5) have equal rewards, y (1, 0) does not."""
    rewards = {"x": [1.0, 1.0], "y": [1.0, 0.0], "z": [0.5, 0.5]}
    return [
        make_rollout(f"{g}{i}", [r], g, logprobs=[-0.1, -0.2])
        for g, rs in rewards.items()
        for i, r in enumerate(rs)
    ]


# The kept group y, rewards (1, 0): reinforce G = R -> (1, 0); grpo, cispo, dr_grpo
# R - mean = (+0.5, -0.5); gspo / (population std 0.5) -> (+1, -1); scalerl c = (+0.5, -0.5)
# over a batch std of sqrt((0.25 + 0.25) / 2) = 0.5 -> (+1, -1).
KEPT_Y = {
    "reinforce": [1.0, 0.0],
    "grpo": [0.5, -0.5],
    "cispo": [0.5, -0.5],
    "dr_grpo": [0.5, -0.5],
    "gspo": [1.0, -1.0],
    "scalerl": [1.0, -1.0],
}


@pytest.mark.parametrize("name", sorted(KEPT_Y))
def test_dynamic_sampling_drops_zero_variance_groups_in_every_preset(name) -> None:
    algo = spec({"name": name, "group_size": 2, "kwargs": {"dynamic_sampling": True}})
    assert algo.dynamic_sampling
    stats = CreditStats()
    items = algo.to_saw_items(zero_variance_rollouts(), stats=stats)
    assert [it.item_id for it in items] == ["y0:0", "y1:0"]
    assert [it.weight for it in items] == pytest.approx(KEPT_Y[name], rel=1e-6)
    assert stats.groups_zero_variance == 2  # x and z
    off = spec({"name": name, "group_size": 2, "kwargs": {"dynamic_sampling": False}})
    stats = CreditStats()
    assert len(off.to_saw_items(zero_variance_rollouts(), stats=stats)) == 6
    assert stats.groups_zero_variance == 0 and not off.dynamic_sampling


def test_dynamic_sampling_defaults_and_scalerls_filter_zvp() -> None:
    for name in ("reinforce", "grpo", "cispo", "gspo", "dr_grpo"):
        assert not spec({"name": name}).dynamic_sampling
    assert spec({"name": "scalerl"}).dynamic_sampling  # ScaleRL's zero-variance filter
    assert not make_scalerl(filter_zvp=False).dynamic_sampling
    assert not make_scalerl(dynamic_sampling=False).dynamic_sampling
    assert make_scalerl(dynamic_sampling=True, filter_zvp=True).dynamic_sampling
    with pytest.raises(ValueError, match="same switch.*give only dynamic_sampling"):
        make_scalerl(dynamic_sampling=True, filter_zvp=False)
    with pytest.raises(ValueError, match="dynamic_sampling='yes' must be true or false"):
        spec({"name": "grpo", "kwargs": {"dynamic_sampling": "yes"}})
    with pytest.raises(ValueError, match="group_size=1 and dynamic sampling drops every group"):
        spec({"name": "grpo", "group_size": 1, "kwargs": {"dynamic_sampling": True}})
    with pytest.raises(ValueError, match="kwargs.dynamic_sampling: false"):
        spec({"name": "scalerl", "group_size": 1})
    assert not spec(
        {"name": "scalerl", "group_size": 1, "kwargs": {"dynamic_sampling": False}}
    ).dynamic_sampling


@pytest.mark.parametrize(
    "make, meta, pending, stamp, match",
    [
        (make_grpo, {"reward": "abc"}, None, None, r"meta.reward='abc' is not a number"),
        (make_grpo, {"reward": [1.0]}, None, None, "is not a number"),
        (make_grpo, {}, PendingBatchStage(1), None, "'grpo' has none"),
        (
            make_scalerl,
            {},
            PendingBatchStage(1),
            make_grpo,
            "another algorithm than this learner's 'scalerl:",
        ),
        (
            make_grpo,
            {},
            None,
            make_cispo,
            "another algorithm than this learner's 'grpo:",
        ),  # same credit
        (make_scalerl, {}, PendingBatchStage("abc"), make_scalerl, "positive"),  # type: ignore[arg-type]
        (make_scalerl, {}, PendingBatchStage(0), make_scalerl, "positive"),
    ],
)
def test_item_problem_names_what_a_step_would_fail_on(
    make: Any, meta: dict[str, Any], pending: Any, stamp: Any, match: str
) -> None:
    # each of these would raise inside Trainer.train_step (float(reward), apply_batch_stage)
    # or train on credit this learner's algorithm would not give: the source dead-letters
    # the item first
    it = make_item(3, 2)
    it.meta.update(meta)
    it.pending = pending
    it.credited_by = None if stamp is None else stamp().fingerprint
    assert re.search(match, make().item_problem(it) or "")


def test_item_problem_passes_items_credit_writes() -> None:
    it = make_item(3, 2)
    assert make_grpo().item_problem(it) is None  # unstamped (hand-written): not checked
    it.credited_by = make_grpo(group_size=4).fingerprint  # a group's size is its request's
    assert make_grpo().item_problem(it) is None
    it.meta.update(reward=1)
    it.pending = PendingBatchStage(2)
    it.credited_by = make_scalerl().fingerprint
    assert make_scalerl().item_problem(it) is None


def test_fingerprint_is_what_decides_the_weight() -> None:
    from libludic.fingerprint import fingerprint_problem

    fp = make_grpo().fingerprint
    assert fingerprint_problem(fp) is None and fp.startswith("grpo:")
    assert make_grpo().fingerprint == fp  # the same config, built again
    # the credit's options change it; the loss's do not (the learner's alone)
    assert make_grpo(normalize_adv=True).fingerprint != fp
    assert make_grpo(eps_clip=0.3).fingerprint == fp
    assert make_grpo(dynamic_sampling=True).fingerprint != fp
    assert make_grpo(mask_no_eos_with_zero=True).fingerprint != fp
    # every item to_saw_items makes carries it
    rs = [make_rollout(f"r{i}", [float(i % 2)], "g") for i in range(8)]
    items = make_grpo().to_saw_items(rs)
    assert items and {it.credited_by for it in items} == {fp}


def test_sapo_and_dapo_presets() -> None:
    from libludic.training.loss import SAPOLoss
    from libludic.training.presets import ALGORITHMS, make_dapo, make_sapo

    sp = make_sapo(tau_neg=2.0)
    assert sp.name == "sapo" and isinstance(sp.loss, SAPOLoss)
    assert (sp.loss.tau_pos, sp.loss.tau_neg) == (1.0, 2.0)
    assert isinstance(sp.credit_assigner, GroupNormalizedReturn)
    # DAPO: clip-higher, token-mean, dynamic sampling, overlong shaping (the run's budget)
    d = make_dapo(max_new_tokens=512, overlong_tokens=128)
    assert d.name == "dapo" and isinstance(d.loss, TokenClippedSurrogateLoss)
    assert (d.loss.eps_clip, d.loss.eps_clip_higher, d.loss.aggregation) == (
        0.2,
        0.28,
        "token-mean",
    )
    assert d.preprocess is drop_zero_variance_groups
    assert d.reward_shaping is not None and d.reward_shaping.overlong_reward_penalty
    assert (d.reward_shaping.overlong_tokens, d.reward_shaping.overlong_penalty_factor) == (
        128,
        1.0,
    )
    with pytest.raises(ValueError, match="give max_new_tokens .* or set overlong_reward_penalty"):
        make_dapo()
    assert make_dapo(overlong_reward_penalty=False).reward_shaping.overlong_reward_penalty is False
    assert {"sapo", "dapo"} <= set(ALGORITHMS)
