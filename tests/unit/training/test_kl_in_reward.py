"""The KL to the reference as a reward penalty (``kl_in_reward``, AReaL's ``kl_ctl``): the
penalised advantages, the loss without a KL term, the default path unchanged, and the option
from a run config to the loss, all on one fixed example worked by hand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from libludic.training import loss as L
from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.training.kl import KLRewardPenalty
from libludic.training.preset_options import preset_arguments
from libludic.training.presets import ALGORITHMS, make_grpo, make_scalerl
from libludic.training.trainer import Trainer
from services.common.settings import load_settings
from services.learner.settings import LearnerSettings
from tests.fakes import ListBatchSource
from tests.unit.training.test_batch_stage_and_kl import ConstLogits, cpu_cfg, kl_item

# The example: 2 sequences of 3 next-token positions (the shifted grid, T = 4 input tokens).
# Sequence 1's middle token is not an action (an observation between two replies): masked.
LN2 = math.log(2.0)
OLD = [[-1.0, -0.5, -2.0], [-1.0, -9.0, -1.0]]  # pi_old's logprobs (the behaviour's)
REF = [[-1.5, -0.5, -1.0], [-1.0 + LN2, 0.0, -1.0 - LN2]]  # the reference's
MASK = [[1, 1, 1], [1, 0, 1]]
ADV = [1.0, -0.5]  # the credit's A_b
COEFF = 0.1
N_TOK = 5  # action tokens: the token-mean's denominator

# k1 = log pi_old - log ref (lr = ref - old, k1 = -lr):
#   seq 0: (-1 + 1.5, -0.5 + 0.5, -2 + 1) = (0.5, 0, -1.0)
#   seq 1: (-1 - (-1 + ln2), [masked: 0, not -9 - 0 = -9], -1 - (-1 - ln2)) = (-ln2, 0, ln2)
# penalty to go, sum_{s >= t} k_s:  seq 0 (-0.5, -1.0, -1.0);  seq 1 (0, ln2, ln2)
# A_t = A_b - 0.1 * to-go:
#   seq 0: 1 - 0.1 * (-0.5, -1, -1) = (1.05, 1.1, 1.1)
#   seq 1: -0.5 - 0.1 * (0, ., ln2) = (-0.5, ., -0.5 - 0.0693147 = -0.5693147)
WANT_K1 = [[1.05, 1.1, 1.1], [-0.5, 0.0, -0.5 - 0.1 * LN2]]
# k3 = e^lr - 1 - lr:
#   seq 0: lr = (-0.5, 0, 1): (e^-0.5 - 0.5, 0, e - 2) = (0.1065307, 0, 0.7182818)
#   seq 1: lr = (ln2, ., -ln2): (2 - 1 - ln2, 0, 1/2 - 1 + ln2) = (0.3068528, 0, 0.1931472)
# to go: seq 0 (0.8248125, 0.7182818, 0.7182818);  seq 1 (0.5, 0.1931472, 0.1931472)
#   seq 0: 1 - 0.1 * to-go = (0.9175188, 0.9281718, 0.9281718)
#   seq 1: -0.5 - 0.1 * (0.5, ., 0.1931472) = (-0.55, ., -0.5193147)
K3 = [[math.exp(-0.5) - 0.5, 0.0, math.e - 2.0], [1.0 - LN2, 0.0, LN2 - 0.5]]
WANT_K3 = [
    [1.0 - 0.1 * (K3[0][0] + K3[0][2]), 1.0 - 0.1 * K3[0][2], 1.0 - 0.1 * K3[0][2]],
    [-0.5 - 0.1 * (K3[1][0] + K3[1][2]), 0.0, -0.5 - 0.1 * K3[1][2]],
]
WANT = {"k1": WANT_K1, "k3": WANT_K3}
# the mean estimate over the 5 action tokens (the stat "kl"):
#   k1: (0.5 + 0 - 1 - ln2 + ln2) / 5 = -0.1;  k3: 1.3248125 / 5 = 0.2649625
WANT_KL = {"k1": -0.5 / N_TOK, "k3": (sum(K3[0]) + sum(K3[1])) / N_TOK}


def test_numbers_of_the_derivation() -> None:
    assert [round(x, 7) for x in WANT_K3[0]] == [0.9175188, 0.9281718, 0.9281718]
    assert [round(WANT_K3[1][0], 7), round(WANT_K3[1][2], 7)] == [-0.55, -0.5193147]
    assert round(WANT_KL["k3"], 7) == 0.2649625


def example() -> tuple[Tensor, dict[str, Any]]:
    """The example as a collated batch, with logits whose logprob of each next token is OLD:
    vocab 2, every token id 0; at position t the logit of id 0 is 0 and that of id 1 is
    log(e^-x - 1), so log softmax_0 = -log(1 + e^-x - 1) = x. pi = pi_old, every ratio 1."""
    B, T = 2, 4
    logits = torch.zeros(B, T, 2)
    for b in range(B):
        for t in range(T - 1):
            logits[b, t, 1] = math.log(math.expm1(-OLD[b][t]))
    pad = torch.zeros(B, 1)
    batch = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "action_mask": torch.tensor([[0, *row] for row in MASK]),
        "weight": torch.tensor(ADV),
        "actor_logprobs": torch.cat([pad, torch.tensor(OLD)], 1),
        "ref_logprobs": torch.cat([pad, torch.tensor(REF)], 1),
    }
    return logits.requires_grad_(), batch


def on_actions(x: Tensor) -> list[list[float]]:
    return torch.where(torch.tensor(MASK) > 0, x, torch.zeros_like(x)).tolist()


@pytest.mark.parametrize("est", ["k1", "k3"])
def test_penalised_advantages_by_hand(est) -> None:
    m = torch.tensor(MASK, dtype=torch.float32)
    adv, k = KLRewardPenalty(COEFF, est).advantages(
        torch.tensor(ADV).unsqueeze(-1), torch.tensor(OLD), torch.tensor(REF), m
    )
    assert on_actions(adv) == [pytest.approx(row, rel=1e-6) for row in WANT[est]]
    assert k[1, 1] == 0.0  # the masked token's -9 is no part of the sums
    assert not adv.requires_grad


@pytest.mark.parametrize("est", ["k1", "k3"])
@pytest.mark.parametrize("off_policy", [{}, {"mismatch_correction": "tis"}], ids=["behav", "tis"])
def test_the_surrogate_sees_the_penalised_advantages_and_no_gradient_through_them(
    est, off_policy
) -> None:
    # every ratio is 1 (unclipped): obj_t = A_t, L = -sum_t A_t / 5 (token mean), e.g.
    #   k1: -(1.05 + 1.1 + 1.1 - 0.5 - 0.5693147) / 5 = -2.1806853 / 5 = -0.4361371
    #   k3: -(2.7738624 - 1.0693147) / 5 = -0.3409095
    # With TIS, pi_old is sg(logp) = OLD too: the same numbers, and the penalty computed from
    # logp must pass no gradient: dL/dlogits = that of -sum_t sg(A_t) exp(logp_t - old_t) / 5.
    logits, batch = example()
    loss_obj = L.TokenClippedSurrogateLoss(
        off_policy=L.OffPolicyCorrection(**off_policy), kl_in_reward=KLRewardPenalty(COEFF, est)
    )
    assert loss_obj.requires.ref_logprobs
    loss, stats = loss_obj.compute(logits, batch)
    want = -sum(map(sum, WANT[est])) / N_TOK
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    assert float(stats["kl"]) == pytest.approx(WANT_KL[est], rel=1e-5, abs=1e-6)
    assert set(stats) == set(loss_obj.stat_keys) == {*type(loss_obj).stat_keys, "kl"}
    loss.backward()
    ref_logits = logits.detach().clone().requires_grad_()
    logp = L.token_logprobs(ref_logits, batch["input_ids"])
    ratio = torch.exp(logp - torch.tensor(OLD))
    (-(torch.tensor(WANT[est]) * ratio * torch.tensor(MASK)).sum() / N_TOK).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)


def test_the_preset_loss_has_no_kl_term_with_kl_in_reward() -> None:
    algo = make_grpo(kl_coeff=COEFF, kl_estimator="k1", kl_in_reward=True)
    assert isinstance(algo.loss, L.TokenClippedSurrogateLoss)  # not a CompositeLoss
    assert algo.loss.kl_in_reward == KLRewardPenalty(COEFF, "k1")
    assert algo.needs_ref_logprobs
    logits, batch = example()
    loss, stats = algo.loss.compute(logits, batch)
    assert float(loss.detach()) == pytest.approx(-sum(map(sum, WANT_K1)) / N_TOK, rel=1e-5)
    assert not any(k.startswith("kl/") for k in stats)


def test_every_preset_with_kl_coeff_takes_kl_in_reward() -> None:
    takes = [n for n, f in ALGORITHMS.items() if "kl_coeff" in preset_arguments(f)]
    assert sorted(takes) == ["cispo", "dapo", "dr_grpo", "grpo", "gspo", "sapo"]
    budget = {"max_new_tokens": 64, "overlong_tokens": 16}  # dapo's overlong shaping
    for name in takes:
        kw = {"kl_coeff": 0.2, "kl_estimator": "k2", "kl_in_reward": True}
        algo = ALGORITHMS[name](**kw, **(budget if name == "dapo" else {}))
        assert isinstance(algo.loss, L.RatioLoss), name
        assert algo.loss.kl_in_reward == KLRewardPenalty(0.2, "k2"), name
        assert algo.needs_ref_logprobs and "kl" in algo.loss.stat_keys, name


def test_off_by_default_the_kl_is_the_loss_term_as_before() -> None:
    # grpo, kl_coeff 0.1 (a KL loss term, k3 of logp = OLD against REF), ratio 1 everywhere:
    #   pg = -(1 + 1 + 1 - 0.5 - 0.5) / 5 = -0.4 (A_b on every action token)
    #   kl = token mean of k3 = 1.3248125 / 5 = 0.2649625
    #   L  = -0.4 + 0.1 * 0.2649625 = -0.3735038
    algo = make_grpo(kl_coeff=COEFF)
    assert isinstance(algo.loss, L.CompositeLoss)
    pg, kl = algo.loss.terms
    assert isinstance(pg.loss, L.RatioLoss) and pg.loss.kl_in_reward is None
    logits, batch = example()
    loss, stats = algo.loss.compute(logits, batch)
    assert float(stats["kl/kl"]) == pytest.approx(WANT_KL["k3"], rel=1e-5)
    assert float(loss.detach()) == pytest.approx(-0.4 + COEFF * WANT_KL["k3"], rel=1e-5)
    # no KL at all: the surrogate alone, its stats the class's fixed keys
    plain = make_grpo().loss
    assert not plain.requires.ref_logprobs  # type: ignore[attr-defined]
    loss, stats = plain.compute(*example())
    assert float(loss.detach()) == pytest.approx(-0.4, rel=1e-5)
    assert set(stats) == set(L.TokenClippedSurrogateLoss.stat_keys)


def test_kl_in_reward_is_validated() -> None:
    with pytest.raises(ValueError, match=r"kl_in_reward=true with kl_coeff=0.0 penalises nothing"):
        make_grpo(kl_in_reward=True)
    with pytest.raises(ValueError, match=r"kl_in_reward='yes' must be true or false"):
        make_grpo(kl_coeff=0.1, kl_in_reward="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"kl_estimator='k4'; use one of \['k1', 'k2', 'k3'\]"):
        make_grpo(kl_coeff=0.1, kl_estimator="k4", kl_in_reward=True)
    with pytest.raises(TypeError, match=r"make_scalerl\(\) got unexpected.*kl_in_reward"):
        make_scalerl(kl_in_reward=True)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"coeff=0.0 must be a number > 0"):
        KLRewardPenalty(0.0)
    with pytest.raises(ValueError, match=r"estimator='k5'; use one of"):
        KLRewardPenalty(0.1, "k5")
    with pytest.raises(ValueError, match=r"KLRewardPenalty\(coeff, estimator\) or None"):
        L.CISPOLoss(kl_in_reward={"coeff": 0.1})  # type: ignore[arg-type]
    logits, batch = example()
    del batch["ref_logprobs"]
    with pytest.raises(KeyError, match=r"TokenClippedSurrogateLoss needs batch\['ref_logprobs'\]"):
        L.TokenClippedSurrogateLoss(kl_in_reward=KLRewardPenalty(0.1)).compute(logits, batch)


def test_a_run_config_with_kl_in_reward_reaches_the_loss(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "algorithm:\n  name: grpo\n  group_size: 2\n"
        "  kwargs: {kl_coeff: 0.1, kl_estimator: k1, kl_in_reward: true}\n"
    )
    settings = load_settings(
        LearnerSettings, ["--config", str(path)], service="learner", environ={}
    )
    algo = settings.spec.build()
    assert algo.needs_ref_logprobs and not isinstance(algo.loss, L.CompositeLoss)
    loss, _ = algo.loss.compute(*example())
    assert float(loss.detach()) == pytest.approx(-sum(map(sum, WANT_K1)) / N_TOK, rel=1e-5)
    # a custom algorithm's ratio loss takes the penalty as {coeff, estimator}
    custom = AlgorithmSpec.from_mapping(
        {
            "name": "custom",
            "kwargs": {
                "credit": {"kind": "GroupNormalizedReturn"},
                "loss": {
                    "kind": "TokenClippedSurrogateLoss",
                    "kwargs": {"kl_in_reward": {"coeff": 0.1, "estimator": "k3"}},
                },
            },
        }
    ).build()
    loss, _ = custom.loss.compute(*example())
    assert float(loss.detach()) == pytest.approx(-sum(map(sum, WANT_K3)) / N_TOK, rel=1e-5)
    bad = {"kind": "CISPOLoss", "kwargs": {"kl_in_reward": {"coef": 0.1}}}
    with pytest.raises(ValueError, match=r"unknown kl_in_reward key\(s\) \['coef'\]"):
        AlgorithmSpec.from_mapping(
            {"name": "custom", "kwargs": {"credit": {"kind": "GroupNormalizedReturn"}, "loss": bad}}
        ).build()


async def test_the_trainer_s_reference_feeds_the_penalty() -> None:
    # test_batch_stage_and_kl's example: policy logits (0, 0), p = (1/2, 1/2) = pi_old (the
    # actor's logprobs); reference logits (0, log 3), p = (1/4, 3/4); A_b = 0; coeff 0.5, k1.
    #   token 1 (id 1): k1 = log 1/2 - log 3/4 = log 2/3;  token 2 (id 0): log 1/2 - log 1/4 = log 2
    #   to go: (log 4/3, log 2) -> A = -0.5 (log 4/3, log 2) = (-0.1438410, -0.3465736)
    #   L = -(A_1 + A_2) / 2 = 0.25 log 8/3 = 0.2452068;  kl = (log 2/3 + log 2) / 2 = 0.1438410
    # dL/dbias = -(1/2) sum_t A_t (onehot(y_t) - p): token 1 (-1/2, 1/2), token 2 (1/2, -1/2)
    #   = -(1/4) (A_2 - A_1) (1, -1) = (1/8) log 1.5 (1, -1) = (0.0506831, -0.0506831):
    #   the step moves pi towards the reference, which k1 as a loss term does not (its
    #   gradient here is 0: test_batch_stage_and_kl.test_kl_estimator_is_a_preset_kwarg)
    def trainer() -> Trainer:
        return Trainer(
            model=ConstLogits([0.0, 0.0]),
            algo=make_grpo(group_size=1, kl_coeff=0.5, kl_estimator="k1", kl_in_reward=True),
            batch_source=ListBatchSource([[kl_item()]]),
            cfg=cpu_cfg(max_grad_norm=None),
            reference_model=ConstLogits([0.0, math.log(3.0)], trainable=False),
        )

    stats = await trainer().train_step()
    assert stats["loss"] == pytest.approx(0.25 * math.log(8.0 / 3.0), rel=1e-5)
    assert stats["loss/kl"] == pytest.approx(math.log(4.0 / 3.0) / 2, rel=1e-5)
    assert "loss/kl/kl" not in stats
    tr = trainer()
    tr.accumulate_gradients([kl_item()])
    g = math.log(1.5) / 8
    assert tr.model.bias.grad.tolist() == pytest.approx([g, -g], rel=1e-5)
