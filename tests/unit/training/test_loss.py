"""Losses: shift convention, aggregation, clipping and KL estimators worked by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from jaxtyping import TypeCheckError
from torch.testing import assert_close

from libludic.training import loss as L

V = 5


def uniform_batch(weights=(1.0, 1.0), action_lens=(2, 1), T=4, ratio=None):
    """Zero logits => log pi(x) = -log V for every token. Actions are the last tokens."""
    B = len(weights)
    input_ids = torch.arange(B * T).reshape(B, T) % V
    action = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(action_lens):
        action[b, T - n :] = 1
    logp = -math.log(V)
    old = torch.zeros(B, T)
    if ratio is not None:  # actor logprob chosen so exp(logp - old) = ratio[b]
        for b, r in enumerate(ratio):
            old[b] = (logp - math.log(r)) * action[b]
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "action_mask": action,
        "weight": torch.tensor(weights, dtype=torch.float32),
        "actor_logprobs": old,
    }
    logits = torch.zeros(B, T, V, requires_grad=True)
    return logits, batch


def test_token_logprobs_shift() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, V)
    ids = torch.randint(0, V, (2, 4))
    got = L.token_logprobs(logits, ids)
    # logits[:, t] predicts ids[:, t+1]
    want = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.shape == (2, 3)
    assert_close(got, want)


def test_reinforce_token_aggregation_value() -> None:
    logits, batch = uniform_batch(weights=(2.0, -1.0), action_lens=(2, 1))
    loss, stats = L.ReinforceLoss().compute(logits, batch)
    # per-token -w*logp = w*log V; tokens: seq0 2 tokens (w=2), seq1 1 token (w=-1)
    # token mean = (2*2 - 1) * log V / 3 = log V
    assert float(loss.detach()) == pytest.approx(math.log(V))
    assert set(stats) == set(L.ReinforceLoss.stat_keys)
    assert float(stats["logp_mean"]) == pytest.approx(-math.log(V))


def test_sequence_aggregation_value() -> None:
    logits, batch = uniform_batch(weights=(2.0, -1.0), action_lens=(2, 1))
    loss, _ = L.ReinforceLoss(aggregation="sequence").compute(logits, batch)
    # per sequence mean: 2 log V and -log V; mean over 2 sequences = 0.5 log V
    assert float(loss.detach()) == pytest.approx(0.5 * math.log(V))


def test_macro_normaliser_from_batch() -> None:
    logits, batch = uniform_batch(weights=(1.0, 1.0), action_lens=(2, 1))
    batch[L.NUM_ACTION_TOKENS_KEY] = 6.0
    loss, _ = L.ReinforceLoss().compute(logits, batch)
    # sum of 3 tokens * log V divided by the macro count 6
    assert float(loss.detach()) == pytest.approx(3 * math.log(V) / 6)


def test_reinforce_gradient_matches_formula() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 3, V, requires_grad=True)
    ids = torch.tensor([[1, 2, 3]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(1, 3, dtype=torch.long),
        "action_mask": torch.tensor([[0, 1, 1]]),
        "weight": torch.tensor([0.5]),
        "actor_logprobs": torch.zeros(1, 3),
    }
    L.ReinforceLoss().compute(logits, batch)[0].backward()
    # d/dlogits[t] of -w/2 * log softmax(logits[t])[y] = -w/2 * (onehot(y) - softmax)
    p = torch.softmax(logits.detach(), -1)
    want = torch.zeros_like(p)
    for t, y in ((0, 2), (1, 3)):
        want[0, t] = -0.25 * (F.one_hot(torch.tensor(y), V).float() - p[0, t])
    assert_close(logits.grad, want)


def test_reinforce_baseline_uses_macro_mean() -> None:
    logits, batch = uniform_batch(weights=(3.0, 1.0), action_lens=(1, 1))
    loss, stats = L.ReinforceBaselineLoss().compute(logits, batch)
    # baseline 2 -> advantages (1, -1) -> token mean of adv*log V = 0
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)
    assert float(stats["baseline"]) == pytest.approx(2.0)
    batch[L.WEIGHT_MEAN_KEY] = 0.0
    loss, _ = L.ReinforceBaselineLoss().compute(logits, batch)
    # baseline 0 -> (3 + 1) log V / 2
    assert float(loss.detach()) == pytest.approx(2 * math.log(V))


@pytest.mark.parametrize(
    "ratio, adv, want_obj, clipped",
    [
        (1.5, 1.0, 1.2, True),  # min(1.5, clip 1.2) = 1.2
        (0.5, 1.0, 0.5, False),  # min(0.5, 0.8) = 0.5
        (1.5, -1.0, -1.5, False),  # min(-1.5, -1.2) = -1.5
        (0.5, -1.0, -0.8, True),  # min(-0.5, -0.8) = -0.8
    ],
)
def test_clipped_surrogate_cases(ratio, adv, want_obj, clipped) -> None:
    logits, batch = uniform_batch(weights=(adv,), action_lens=(1,), ratio=(ratio,))
    loss, stats = L.TokenClippedSurrogateLoss(eps_clip=0.2).compute(logits, batch)
    assert float(loss.detach()) == pytest.approx(-want_obj, rel=1e-5)
    assert float(stats["clip_frac"]) == (1.0 if clipped else 0.0)
    assert float(stats["ratio_mean"]) == pytest.approx(ratio, rel=1e-5)
    loss.backward()
    # a clipped token passes no gradient
    assert (logits.grad.abs().sum() == 0) == clipped


def test_clip_higher_is_asymmetric() -> None:
    logits, batch = uniform_batch(weights=(1.0,), action_lens=(1,), ratio=(1.25,))
    loss, _ = L.TokenClippedSurrogateLoss(eps_clip=0.2, eps_clip_higher=0.28).compute(logits, batch)
    # 1.25 < 1 + 0.28: unclipped, obj = 1.25
    assert float(loss.detach()) == pytest.approx(-1.25, rel=1e-5)


def test_dual_clip_bounds_negative_advantage() -> None:
    logits, batch = uniform_batch(weights=(-1.0,), action_lens=(1,), ratio=(5.0,))
    loss, stats = L.TokenClippedSurrogateLoss(c_clip=3.0).compute(logits, batch)
    # obj = min(-5, -1.2) = -5, floored at c*A = -3 -> loss 3
    assert float(loss.detach()) == pytest.approx(3.0, rel=1e-5)
    assert float(stats["dual_clip_frac"]) == 1.0
    with pytest.raises(ValueError, match="c_clip"):
        L.TokenClippedSurrogateLoss(c_clip=0.5)


def test_cispo_value_and_stop_gradient() -> None:
    logits, batch = uniform_batch(weights=(2.0,), action_lens=(1,), ratio=(1.5,))
    loss, stats = L.CISPOLoss(eps_clip_high=0.2).compute(logits, batch)
    # is_w = clip(1.5, 0, 1.2) = 1.2;  loss = -1.2 * 2 * (-log V)
    assert float(loss.detach()) == pytest.approx(2.4 * math.log(V), rel=1e-5)
    assert float(stats["clip_frac"]) == 1.0
    loss.backward()
    g_cispo = logits.grad.clone()
    logits2, batch2 = uniform_batch(weights=(2.0,), action_lens=(1,))
    L.ReinforceLoss().compute(logits2, batch2)[0].backward()
    # stop-gradient: grad = 1.2 * grad of plain REINFORCE (the weight is a constant)
    assert_close(g_cispo, 1.2 * logits2.grad)


def test_cispo_low_clip() -> None:
    logits, batch = uniform_batch(weights=(1.0,), action_lens=(1,), ratio=(0.1,))
    no_low, _ = L.CISPOLoss().compute(logits, batch)
    low, _ = L.CISPOLoss(eps_clip_low=0.2).compute(logits, batch)
    # weights 0.1 (unbounded below) and 0.8 times log V
    assert float(no_low.detach()) == pytest.approx(0.1 * math.log(V), rel=1e-5)
    assert float(low.detach()) == pytest.approx(0.8 * math.log(V), rel=1e-5)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators(est) -> None:
    logits, batch = uniform_batch(weights=(1.0,), action_lens=(1,))
    d = 0.3  # ref logprob = logp - 0.3  => lr = ref - logp = -0.3
    batch["ref_logprobs"] = (-math.log(V) - d) * batch["action_mask"].float()
    loss, stats = L.TokenKLLoss(coeff=2.0, estimator=est).compute(logits, batch)
    lr = -d
    want = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": math.exp(lr) - 1 - lr}[est]
    assert float(stats["kl"]) == pytest.approx(want, rel=1e-4)
    assert float(loss.detach()) == pytest.approx(2.0 * want, rel=1e-4)


def test_kl_needs_ref_logprobs() -> None:
    logits, batch = uniform_batch()
    with pytest.raises(KeyError, match="ref_logprobs"):
        L.TokenKLLoss().compute(logits, batch)


def test_cross_entropy_matches_torch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 5, V)
    ids = torch.randint(0, V, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 0]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.tensor([[1] * 5, [1, 1, 1, 1, 0]]),
        "action_mask": mask,
        "weight": torch.ones(2),
        "actor_logprobs": torch.zeros(2, 5),
    }
    loss, stats = L.MaskedCausalLMCrossEntropyLoss().compute(logits, batch)
    labels = torch.where(mask[:, 1:] == 1, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    want = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    assert_close(loss, want)
    assert set(stats) == set(L.MaskedCausalLMCrossEntropyLoss.stat_keys)


def test_composite_sums_terms_with_prefixed_stats() -> None:
    logits, batch = uniform_batch(weights=(1.0, 1.0))
    batch["ref_logprobs"] = torch.zeros(2, 4)
    comp = L.CompositeLoss(
        terms=[L.LossTerm("pg", L.ReinforceLoss()), L.LossTerm("kl", L.TokenKLLoss(), 0.1)]
    )
    loss, stats = comp.compute(logits, batch)
    a, _ = L.ReinforceLoss().compute(logits, batch)
    b, _ = L.TokenKLLoss().compute(logits, batch)
    assert float(loss.detach()) == pytest.approx(
        float(a.detach()) + 0.1 * float(b.detach()), rel=1e-6
    )
    assert set(stats) == set(comp.stat_keys)
    assert {"loss", "pg/loss", "kl/kl"} <= set(stats)
    assert comp.requires == L.LossInputs(ref_logprobs=True)
    with pytest.raises(ValueError, match="unique"):
        L.CompositeLoss(
            terms=[L.LossTerm("x", L.ReinforceLoss()), L.LossTerm("x", L.ReinforceLoss())]
        )


@pytest.mark.parametrize(
    "loss_obj",
    [
        L.ReinforceLoss(),
        L.ReinforceBaselineLoss(),
        L.TokenClippedSurrogateLoss(),
        L.CISPOLoss(),
        L.GSPOLoss(),
    ],
)
def test_stat_keys_fixed(loss_obj) -> None:
    logits, batch = uniform_batch(ratio=(1.0, 1.0))
    _, stats = loss_obj.compute(logits, batch)
    assert tuple(sorted(stats)) == tuple(sorted(type(loss_obj).stat_keys))


# ---------------------------------------------------------------------------------- entropy

PG_LOSSES = [
    L.ReinforceLoss(),
    L.ReinforceBaselineLoss(),
    L.TokenClippedSurrogateLoss(),
    L.CISPOLoss(),
    L.GSPOLoss(),
]


@pytest.mark.parametrize("loss_obj", PG_LOSSES, ids=lambda x: type(x).__name__)
def test_every_policy_gradient_loss_reports_the_exact_entropy(loss_obj) -> None:
    logits, batch = uniform_batch(ratio=(1.0, 1.0))
    # zero logits: p = 1/V on every row, H = -sum_v (1/V) log(1/V) = log V = log 5 = 1.609
    _, stats = loss_obj.compute(logits, batch)
    assert "entropy" in type(loss_obj).stat_keys
    assert float(stats["entropy"]) == pytest.approx(math.log(V), rel=1e-6)
    assert not stats["entropy"].requires_grad


def test_entropy_is_the_mean_over_action_tokens_only() -> None:
    # one sequence, T = 4, actions at input positions 2 and 3: shifted-grid rows t = 1, 2
    # (logits[:, t] predicts input_ids[:, t+1]). Row 1 uniform: H = log 5. Row 2 peaked,
    # logits (ln 4, 0, 0, 0, 0): p = (4, 1, 1, 1, 1) / 8, H = -(1/2) ln(1/2) - 4 (1/8) ln(1/8)
    # = (1/2) ln 2 + (3/2) ln 2 = 2 ln 2. Rows 0 and 3 (not actions) are one-hot-ish, H ~ 0,
    # and must not count: mean = (ln 5 + 2 ln 2) / 2 = ln(20) / 2 = 1.498
    logits = torch.zeros(1, 4, V)
    logits[0, 0, 0] = logits[0, 3, 0] = 50.0
    logits[0, 2, 0] = math.log(4)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert float(L.token_entropy(logits, mask)) == pytest.approx(math.log(20) / 2, rel=1e-6)
    # no action tokens: 0, like the means
    assert float(L.token_entropy(logits, torch.zeros(1, 3))) == 0.0


@pytest.mark.parametrize("budget", [1, 7, 2 * 7 + 3, 10**6], ids=lambda b: f"elements{b}")
def test_chunked_entropy_equals_the_unchunked_formula(budget) -> None:
    """A budget of 1 element reads one row at a time (rows = max(1, 1 // V)); 2V+3 reads two
    rows at a time with a short last chunk; 10**6 takes every row at once."""
    torch.manual_seed(3)
    logits = (3 * torch.randn(3, 6, 7)).requires_grad_()
    mask = (torch.rand(3, 5) > 0.4).float()
    assert 0 < mask.sum() < mask.numel()
    # H_bt = -sum_v p log p on the full [B, T-1, V] grid, then the masked mean
    lp = torch.log_softmax(logits.detach()[:, :-1], -1)
    want = ((-(lp.exp() * lp).sum(-1)) * mask).sum() / mask.sum()
    got = L.token_entropy(logits, mask, max_elements=budget)
    assert_close(got, want)
    assert not got.requires_grad


def test_bad_aggregation_rejected() -> None:
    with pytest.raises(ValueError, match="aggregation"):
        L.ReinforceLoss(aggregation="mean")


def test_typecheck_flag(monkeypatch) -> None:
    logits, batch = uniform_batch()
    batch["weight"] = torch.ones(3)  # wrong: B is 2
    monkeypatch.setenv("LUDIC_TYPECHECK", "1")
    with pytest.raises(TypeCheckError, match="weight"):
        L.MaskedCausalLMCrossEntropyLoss().compute(logits, batch)
    monkeypatch.setenv("LUDIC_TYPECHECK", "0")
    # off: the CE loss ignores weight, so the bad batch goes through unchecked
    L.MaskedCausalLMCrossEntropyLoss().compute(logits, batch)


# ------------------------------------------------------------ train/inference mismatch (TIS / MIS)
# uniform_batch(ratio=...) sets each action token's behaviour logprob so that
# rho = exp(t - b) = ratio[b] on every action token of sequence b (t = -log V, the trainer's).


def off(correction=None, level="token", cap=2.0):
    return L.OffPolicyCorrection(correction, level, cap)


def test_mismatch_stats_without_correction() -> None:
    logits, batch = uniform_batch(weights=(1.0, 1.0), action_lens=(2, 1), ratio=(3.0, 0.5))
    loss, stats = L.TokenClippedSurrogateLoss().compute(logits, batch)
    # pi_old is the behaviour policy: seq0 ratio 3 is clipped to 1.2, seq1 0.5 is not
    # (min(0.5, 0.8) = 0.5): L = -(1.2 + 1.2 + 0.5) / 3
    assert float(loss.detach()) == pytest.approx(-2.9 / 3, rel=1e-5)
    # |t - b| = ln 3, ln 3, ln 2;  k3 = rho - 1 - ln rho = 2 - ln 3 (x2), 0.5 - 1 + ln 2
    assert float(stats["mismatch_logprob_gap"]) == pytest.approx(
        (2 * math.log(3) + math.log(2)) / 3, rel=1e-5
    )
    assert float(stats["mismatch_kl"]) == pytest.approx(
        (2 * (2 - math.log(3)) + math.log(2) - 0.5) / 3, rel=1e-5
    )
    assert float(stats["mismatch_weight_mean"]) == 1.0
    assert float(stats["mismatch_capped_frac"]) == 0.0


@pytest.mark.parametrize(
    "correction, want_w, want_capped",
    [
        ("tis", (2.0, 2.0, 0.5), 2 / 3),  # min(3, 2) = 2 on both seq0 tokens; 0.5 kept
        ("mis", (0.0, 0.0, 0.5), 2 / 3),  # 3 > 2: both seq0 tokens dropped; 0.5 kept as is
    ],
)
def test_token_level_mismatch_correction_on_the_clipped_surrogate(
    correction, want_w, want_capped
) -> None:
    logits, batch = uniform_batch(weights=(1.0, 1.0), action_lens=(2, 1), ratio=(3.0, 0.5))
    loss_obj = L.TokenClippedSurrogateLoss(eps_clip=0.2, off_policy=off(correction))
    loss, stats = loss_obj.compute(logits, batch)
    # pi_old = t, so r = 1 (not clipped) and obj = A = 1 per token: L = -sum(w) / 3 tokens
    assert float(loss.detach()) == pytest.approx(-sum(want_w) / 3, rel=1e-5)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0)
    assert float(stats["clip_frac"]) == 0.0
    assert float(stats["mismatch_weight_mean"]) == pytest.approx(sum(want_w) / 3, rel=1e-5)
    assert float(stats["mismatch_capped_frac"]) == pytest.approx(want_capped)
    loss.backward()
    # gradient of -sum_t sg(w_t) A logp_t / 3: REINFORCE with per-sequence weights w
    # (seq0's two tokens share one w). Uncorrected, seq0's clipped ratio would pass none.
    logits2, batch2 = uniform_batch(weights=(want_w[0], want_w[2]), action_lens=(2, 1))
    L.ReinforceLoss().compute(logits2, batch2)[0].backward()
    assert_close(logits.grad, logits2.grad)


@pytest.mark.parametrize(
    "level, correction, want_w, want_capped",
    [
        # token level: rho = 1.5, 1.5 (seq0) and 0.5 (seq1), all under the cap 2
        ("token", "tis", (1.5, 1.5, 0.5), 0.0),
        ("token", "mis", (1.5, 1.5, 0.5), 0.0),
        # sequence level: rho(seq0) = 1.5 * 1.5 = 2.25 > 2 (both its tokens), rho(seq1) = 0.5
        ("sequence", "tis", (2.0, 2.0, 0.5), 2 / 3),
        ("sequence", "mis", (0.0, 0.0, 0.5), 2 / 3),
    ],
)
def test_sequence_level_ratio_is_the_product_over_the_sequence(
    level, correction, want_w, want_capped
) -> None:
    logits, batch = uniform_batch(weights=(1.0, 1.0), action_lens=(2, 1), ratio=(1.5, 0.5))
    loss, stats = L.TokenClippedSurrogateLoss(off_policy=off(correction, level)).compute(
        logits, batch
    )
    assert float(loss.detach()) == pytest.approx(-sum(want_w) / 3, rel=1e-5)
    assert float(stats["mismatch_capped_frac"]) == pytest.approx(want_capped)


def test_mismatch_correction_on_cispo() -> None:
    logits, batch = uniform_batch(weights=(1.0, 1.0), action_lens=(2, 1), ratio=(3.0, 0.5))
    loss, stats = L.CISPOLoss(off_policy=off("tis")).compute(logits, batch)
    # r = 1 against pi_old = t, so the CISPO weight is 1; TIS w = 2, 2, 0.5
    # L = -sum(w * 1 * A * logp) / 3 = (2 + 2 + 0.5) log V / 3 = 1.5 log V
    assert float(loss.detach()) == pytest.approx(1.5 * math.log(V), rel=1e-5)
    assert float(stats["mismatch_capped_frac"]) == pytest.approx(2 / 3)
    loss.backward()
    logits2, batch2 = uniform_batch(weights=(2.0, 0.5), action_lens=(2, 1))
    L.ReinforceLoss().compute(logits2, batch2)[0].backward()
    assert_close(logits.grad, logits2.grad)


def test_mismatch_options_are_validated() -> None:
    with pytest.raises(ValueError, match="mismatch_correction='ois'"):
        off("ois")
    with pytest.raises(ValueError, match="mismatch_level='group'"):
        off("tis", "group")
    with pytest.raises(ValueError, match="mismatch_cap=0.5 must be >= 1"):
        off("tis", cap=0.5)


# ------------------------------------------------------------------- decoupled PPO (AReaL)


def decoupled_batch(r=(1.5, 0.5), v=(3.0, 0.5)):
    """Sequence b's action tokens get prox and behaviour logprobs such that
    exp(logp - prox) = r[b] and exp(prox - behav) = v[b] (logp = -log V)."""
    logits, batch = uniform_batch(weights=(1.0, 1.0), action_lens=(2, 1))
    act = batch["action_mask"].float()
    logp = -math.log(V)
    prox = torch.stack([(logp - math.log(r[b])) * act[b] for b in range(2)])
    batch[L.PROX_LOGPROBS_KEY] = prox
    batch["actor_logprobs"] = torch.stack([(prox[b] - math.log(v[b])) * act[b] for b in range(2)])
    return logits, batch


def decoupled(cap=None, **kw):
    return L.OffPolicyCorrection(use_decoupled_loss=True, behav_imp_weight_cap=cap, **kw)


def test_decoupled_ppo_clips_against_prox_and_filters_behaviour_weights_above_the_cap() -> None:
    logits, batch = decoupled_batch()
    loss_obj = L.TokenClippedSurrogateLoss(eps_clip=0.2, off_policy=decoupled(cap=2.0))
    loss, stats = loss_obj.compute(logits, batch)
    # r against prox: seq0 min(1.5, 1.2) = 1.2 (clipped), seq1 min(0.5, 0.8) = 0.5
    # v = exp(prox - behav): seq0 3 > cap 2 -> both tokens filtered (w 0), seq1 w = 0.5
    # L = -(0 * 1.2 * 2 + 0.5 * 0.5) / 3 tokens
    assert float(loss.detach()) == pytest.approx(-0.25 / 3, rel=1e-5)
    assert float(stats["ratio_mean"]) == pytest.approx(3.5 / 3, rel=1e-5)
    assert float(stats["clip_frac"]) == pytest.approx(2 / 3)
    assert float(stats["mismatch_weight_mean"]) == pytest.approx(0.5 / 3, rel=1e-5)
    assert float(stats["mismatch_capped_frac"]) == pytest.approx(2 / 3)
    # |prox - behav| = ln 3, ln 3, ln 2
    assert float(stats["mismatch_logprob_gap"]) == pytest.approx(
        (2 * math.log(3) + math.log(2)) / 3, rel=1e-5
    )
    loss.backward()
    # only seq1 passes gradient: d(-w r A)/dlogits = -0.5 * r * grad logp = -0.25 grad logp,
    # over 3 tokens: REINFORCE with weights (0, 0.25)
    logits2, batch2 = uniform_batch(weights=(0.0, 0.25), action_lens=(2, 1))
    L.ReinforceLoss().compute(logits2, batch2)[0].backward()
    assert_close(logits.grad, logits2.grad)
    # without a cap seq0 keeps its weight 3: L = -(3 * 1.2 * 2 + 0.5 * 0.5) / 3
    loss, stats = L.TokenClippedSurrogateLoss(off_policy=decoupled()).compute(*decoupled_batch())
    assert float(loss.detach()) == pytest.approx(-7.45 / 3, rel=1e-5)
    assert float(stats["mismatch_capped_frac"]) == 0.0


def test_recompute_logprob_replaces_the_behaviour_logprobs_without_weights() -> None:
    logits, batch = decoupled_batch()
    off_pol = L.OffPolicyCorrection(recompute_logprob=True)
    loss, stats = L.TokenClippedSurrogateLoss(off_policy=off_pol).compute(logits, batch)
    # pi_old = prox: obj 1.2, 1.2, 0.5 as above, w = 1: L = -(1.2 + 1.2 + 0.5) / 3
    assert float(loss.detach()) == pytest.approx(-2.9 / 3, rel=1e-5)
    assert float(stats["mismatch_weight_mean"]) == 1.0


def test_a_mismatch_correction_takes_pi_old_from_the_prox_logprobs_the_batch_carries() -> None:
    """TIS with several minibatches: the Trainer puts the step's starting policy in the batch
    (prox), which is then pi_old and the t of rho; without it pi_old is sg(logp)."""
    # per action token exp(logp - prox) = 1.5, 1.5, 0.5 and exp(prox - b) = 3, 3, 0.5
    logits, batch = decoupled_batch()
    loss_obj = L.TokenClippedSurrogateLoss(eps_clip=0.2, off_policy=off("tis"))
    assert loss_obj.requires.pi_old_is_trained and not loss_obj.requires.prox_logprobs
    loss, stats = loss_obj.compute(logits, batch)
    # r against prox: min(1.5, 1.2) = 1.2 (x2), min(0.5, 0.8) = 0.5; w = min(rho, 2) with
    # rho = exp(prox - b) = 3, 3, 0.5 -> 2, 2, 0.5: L = -(2 * 1.2 * 2 + 0.5 * 0.5) / 3
    assert float(loss.detach()) == pytest.approx(-5.05 / 3, rel=1e-5)
    assert float(stats["ratio_mean"]) == pytest.approx(3.5 / 3, rel=1e-5)
    assert float(stats["mismatch_weight_mean"]) == pytest.approx(4.5 / 3, rel=1e-5)
    # the same batch without prox: pi_old = sg(logp), r = 1; rho = exp(logp - b) = 1.5 * 3
    # = 4.5 -> 2 (x2), 0.5 * 0.5 = 0.25: L = -(2 + 2 + 0.25) / 3, the drift in w, not in r
    del batch[L.PROX_LOGPROBS_KEY]
    loss, stats = loss_obj.compute(logits, batch)
    assert float(loss.detach()) == pytest.approx(-4.25 / 3, rel=1e-5)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0)
    assert (
        not L.TokenClippedSurrogateLoss().requires.pi_old_is_trained
    )  # pi_old = b: no prox needed


def test_decoupled_cispo() -> None:
    logits, batch = decoupled_batch()
    loss, _ = L.CISPOLoss(eps_clip_high=0.2, off_policy=decoupled(cap=2.0)).compute(logits, batch)
    # CISPO weight sg(clip(r, 0, 1.2)) = 1.2, 1.2, 0.5; decoupled w = 0, 0, 0.5
    # L = -sum(w * is_w * A * logp) / 3 = 0.5 * 0.5 * log V / 3
    assert float(loss.detach()) == pytest.approx(0.25 * math.log(V) / 3, rel=1e-5)


def test_prox_logprobs_are_required_and_announced() -> None:
    logits, batch = decoupled_batch()
    del batch[L.PROX_LOGPROBS_KEY]
    loss_obj = L.TokenClippedSurrogateLoss(off_policy=decoupled())
    with pytest.raises(KeyError, match=r"needs batch\['prox_logprobs'\].*algo.needs_prox_logprobs"):
        loss_obj.compute(logits, batch)
    assert loss_obj.requires.prox_logprobs
    assert L.CISPOLoss(
        off_policy=L.OffPolicyCorrection(recompute_logprob=True)
    ).requires.prox_logprobs
    assert not L.TokenClippedSurrogateLoss(off_policy=off("tis")).requires.prox_logprobs
    comp = L.CompositeLoss(terms=[L.LossTerm("pg", loss_obj), L.LossTerm("kl", L.TokenKLLoss())])
    assert comp.requires.prox_logprobs and comp.requires.ref_logprobs


def test_decoupled_options_are_validated() -> None:
    with pytest.raises(ValueError, match="behav_imp_weight_cap=5.0 needs use_decoupled_loss=True"):
        L.OffPolicyCorrection(behav_imp_weight_cap=5.0)
    with pytest.raises(ValueError, match="behav_imp_weight_cap=1.0 must be > 1"):
        decoupled(cap=1.0)
    with pytest.raises(ValueError, match="choose one"):
        decoupled(mismatch_correction="tis")


# ------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize(
    "mode, want",
    [
        # per-token l = -w logp = w log V: seq0 (w=2) two tokens 2 log V each, seq1 (w=-1) -log V
        ("token-mean", (4 - 1) / 3),  # sum over 3 tokens / 3
        ("token", (4 - 1) / 3),  # alias
        ("seq-mean-token-mean", (4 / 2 - 1) / 2),  # per-sequence means 2 and -1, mean of 2
        ("sequence", (4 / 2 - 1) / 2),  # alias
        ("seq-mean-token-sum", (4 - 1) / 2),  # per-sequence sums 4 and -1, mean of 2
        ("seq-mean-token-sum-norm", (4 - 1) / (2 * 8)),  # the sums / C = 8, mean of 2
    ],
)
def test_aggregations(mode, want) -> None:
    logits, batch = uniform_batch(weights=(2.0, -1.0), action_lens=(2, 1))
    loss, _ = L.ReinforceLoss(aggregation=mode, max_new_tokens=8).compute(logits, batch)
    assert float(loss.detach()) == pytest.approx(want * math.log(V), rel=1e-5)


def test_sequence_sum_aggregations_use_the_macro_sequence_count() -> None:
    logits, batch = uniform_batch(weights=(2.0, -1.0), action_lens=(2, 1))
    batch[L.NUM_SEQUENCES_KEY] = 4.0
    loss, _ = L.ReinforceLoss(aggregation="seq-mean-token-sum").compute(logits, batch)
    # (4 - 1) log V summed over the micro-batch's sequences, over the macro count 4
    assert float(loss.detach()) == pytest.approx(3 * math.log(V) / 4, rel=1e-5)
    loss, _ = L.CISPOLoss(aggregation="seq-mean-token-sum-norm", max_new_tokens=2).compute(
        *uniform_batch(weights=(2.0, -1.0), action_lens=(2, 1), ratio=(1.0, 1.0))
    )
    # CISPO at r = 1 is REINFORCE: (4 - 1) log V / (2 sequences * C = 2)
    assert float(loss.detach()) == pytest.approx(3 * math.log(V) / 4, rel=1e-5)


def test_aggregation_is_validated() -> None:
    with pytest.raises(ValueError, match="needs max_new_tokens"):
        L.TokenClippedSurrogateLoss(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(
        ValueError, match="TokenKLLoss does not take aggregation='seq-mean-token-sum-norm'"
    ):
        L.TokenKLLoss(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an integer >= 1"):
        L.CISPOLoss(max_new_tokens=0)
    with pytest.raises(
        ValueError, match=r"aggregation='seq-mean'; use one of .*'seq-mean-token-sum'"
    ):
        L.GSPOLoss(aggregation="seq-mean")


def test_dr_grpo_aggregation_on_the_clipped_surrogate() -> None:
    logits, batch = uniform_batch(weights=(2.0, -1.0), action_lens=(2, 1), ratio=(1.0, 1.0))
    loss_obj = L.TokenClippedSurrogateLoss(aggregation="seq-mean-token-sum-norm", max_new_tokens=4)
    loss, _ = loss_obj.compute(logits, batch)
    # r = 1: obj = A per token; sums 2 * 2 = 4 and -1; L = -(4 - 1) / (2 sequences * C = 4)
    assert float(loss.detach()) == pytest.approx(-3 / 8, rel=1e-5)
    loss.backward()
    # every token's gradient weight is A / (N_seq C), whatever its sequence's length:
    # the same as token-mean REINFORCE over 3 tokens with weights scaled by 3 / 8
    logits2, batch2 = uniform_batch(weights=(2.0 * 3 / 8, -1.0 * 3 / 8), action_lens=(2, 1))
    L.ReinforceLoss().compute(logits2, batch2)[0].backward()
    assert_close(logits.grad, logits2.grad)


# ---------------------------------------------------------------------------------- GSPO


def gspo_batch(token_ratios, weights):
    """Two sequences (2 action tokens, 1 action token); token_ratios[b][k] = exp(logp - b) of
    sequence b's k-th action token (logp = -log V)."""
    logits, batch = uniform_batch(weights=weights, action_lens=(2, 1))
    logp = -math.log(V)
    old = torch.zeros(2, 4)
    for b, rs in enumerate(token_ratios):
        for k, r in enumerate(rs):
            old[b, 4 - len(rs) + k] = logp - math.log(r)
    batch["actor_logprobs"] = old
    return logits, batch


def test_gspo_sequence_ratio_is_the_geometric_mean_of_the_token_ratios() -> None:
    logits, batch = gspo_batch([(2.0, 0.5), (1.0,)], weights=(2.0, 1.0))
    loss, stats = L.GSPOLoss().compute(logits, batch)
    # s0 = exp((ln 2 + ln 0.5) / 2) = 1 (token PPO would clip both), s1 = 1: nothing clipped
    # obj = s A = 2 and 1; seq-mean-token-mean: L = -(2 + 1) / 2
    assert float(loss.detach()) == pytest.approx(-1.5, rel=1e-5)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0, rel=1e-5)
    assert float(stats["clip_frac"]) == 0.0
    loss.backward()
    # grad s_b = s_b mean_t grad logp_bt: -(1/2) [2 * (g_a + g_b) / 2 + 1 * g_c], which is
    # sequence-mean REINFORCE with weights (2, 1)
    logits2, batch2 = uniform_batch(weights=(2.0, 1.0), action_lens=(2, 1))
    L.ReinforceLoss(aggregation="seq-mean-token-mean").compute(logits2, batch2)[0].backward()
    assert_close(logits.grad, logits2.grad)


def test_gspo_clips_whole_sequences_with_the_paper_ranges() -> None:
    logits, batch = gspo_batch([(1.01, 1.01), (0.99,)], weights=(1.0, 1.0))
    loss, stats = L.GSPOLoss().compute(logits, batch)
    # s0 = 1.01 > 1 + 4e-4 with A > 0: obj = 1.0004 (clipped, no gradient)
    # s1 = 0.99 < 1 - 3e-4 with A > 0: min(0.99, 0.9997) = 0.99 (unclipped)
    assert float(loss.detach()) == pytest.approx(-(1.0004 + 0.99) / 2, rel=1e-5)
    assert float(stats["clip_frac"]) == pytest.approx(2 / 3)  # seq0's 2 tokens of 3
    assert float(stats["ratio_mean"]) == pytest.approx((2 * 1.01 + 0.99) / 3, rel=1e-5)
    loss.backward()
    # only seq1: -(1/2) * A * s1 * grad logp_c = sequence-mean REINFORCE with weights (0, 0.99)
    logits2, batch2 = uniform_batch(weights=(0.0, 0.99), action_lens=(2, 1))
    L.ReinforceLoss(aggregation="seq-mean-token-mean").compute(logits2, batch2)[0].backward()
    assert_close(logits.grad, logits2.grad)


def test_gspo_takes_the_off_policy_correction() -> None:
    logits, batch = gspo_batch([(3.0, 3.0), (0.5,)], weights=(1.0, 1.0))
    loss_obj = L.GSPOLoss(off_policy=off("tis"))
    loss, stats = loss_obj.compute(logits, batch)
    # pi_old = t: s = 1, obj = A = 1; TIS w = min(3, 2) = 2 (seq0 tokens), 0.5 (seq1)
    # seq-mean-token-mean: L = -((2 + 2) / 2 + 0.5) / 2
    assert float(loss.detach()) == pytest.approx(-1.25, rel=1e-5)
    assert float(stats["mismatch_capped_frac"]) == pytest.approx(2 / 3)
    assert set(stats) == set(L.GSPOLoss.stat_keys)
    assert L.GSPOLoss(off_policy=decoupled()).requires.prox_logprobs


# ------------------------------------------------------------------------ importance-weight max


@pytest.mark.parametrize("loss_cls", [L.TokenClippedSurrogateLoss, L.CISPOLoss])
def test_ratio_max_is_the_largest_token_ratio(loss_cls) -> None:
    # per-token ratios exp(logp - old): 1.5, 1.5 (seq0's 2 tokens), 0.25 (seq1's 1 token)
    logits, batch = uniform_batch(weights=(1.0, -1.0), action_lens=(2, 1), ratio=(1.5, 0.25))
    _, stats = loss_cls().compute(logits, batch)
    assert float(stats["ratio_max"]) == pytest.approx(1.5, rel=1e-5)
    # the mean for contrast: (1.5 + 1.5 + 0.25) / 3 = 1.0833
    assert float(stats["ratio_mean"]) == pytest.approx(3.25 / 3, rel=1e-5)


def test_gspo_ratio_max_is_the_largest_sequence_ratio() -> None:
    logits, batch = gspo_batch([(4.0, 1.0), (1.5,)], weights=(1.0, 1.0))
    _, stats = L.GSPOLoss().compute(logits, batch)
    # s0 = exp((ln 4 + ln 1) / 2) = 2, s1 = 1.5: the max is s0 = 2, not the token ratio 4
    assert float(stats["ratio_max"]) == pytest.approx(2.0, rel=1e-5)


@pytest.mark.parametrize(
    "correction, want_max",
    [
        (None, 1.0),  # no correction: w = 1 on every token
        ("tis", 2.0),  # w = min(rho, 2) = (2, 2, 0.5)
        ("mis", 0.5),  # w = rho 1[rho <= 2] = (0, 0, 0.5)
    ],
)
def test_mismatch_weight_max(correction, want_max) -> None:
    # rho = 3 on seq0's 2 tokens, 0.5 on seq1's token (see uniform_batch)
    logits, batch = uniform_batch(weights=(1.0, 1.0), action_lens=(2, 1), ratio=(3.0, 0.5))
    _, stats = L.TokenClippedSurrogateLoss(off_policy=off(correction)).compute(logits, batch)
    assert float(stats["mismatch_weight_max"]) == pytest.approx(want_max, rel=1e-5)


def test_masked_max_skips_padding_and_is_zero_without_tokens() -> None:
    x = torch.tensor([[0.5, 9.0, 2.0], [3.0, 1.0, 7.0]])
    m = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    # the action values are 0.5, 2, 3, 1: max 3 (9 and 7 are off the mask)
    assert float(L.masked_max(x, m)) == 3.0
    assert float(L.masked_max(x, torch.zeros_like(m))) == 0.0
    # a [B, 1] per-sequence value is broadcast over the tokens: seq1's 4.0 has no tokens
    assert float(L.masked_max(torch.tensor([[2.5], [4.0]]), torch.tensor([[1.0], [0.0]]))) == 2.5


def test_the_combine_rule_is_max_for_max_keys_only() -> None:
    assert L.is_max_stat("ratio_max") and L.is_max_stat("pg/mismatch_weight_max")
    assert not L.is_max_stat("ratio_mean") and not L.is_max_stat("entropy")


def test_a_loss_declares_its_inputs_once_and_the_former_flags_are_refused() -> None:
    assert L.loss_inputs(L.ReinforceLoss()) == L.NO_INPUTS
    assert L.loss_inputs(L.TokenClippedSurrogateLoss()) == L.LossInputs(actor_logprobs=True)
    assert L.LossInputs(actor_logprobs=True) | L.LossInputs(ref_logprobs=True) == L.LossInputs(
        actor_logprobs=True, ref_logprobs=True
    )

    class SpecLoss:  # the spec's Protocol: compute() alone reads nothing more
        def compute(self, logits, batch):
            raise NotImplementedError

    class Former(SpecLoss):
        needs_actor_logprobs = True
        needs_prox_logprobs = False

    class Wrong(SpecLoss):
        requires = {"actor_logprobs": True}

    assert L.loss_inputs(SpecLoss()) == L.NO_INPUTS
    with pytest.raises(
        TypeError,
        match=r"Former declares \['needs_actor_logprobs'\].*"
        r"requires = LossInputs\(actor_logprobs=True\)",
    ):
        L.loss_inputs(Former())
    with pytest.raises(TypeError, match="Wrong.requires is .* not a LossInputs"):
        L.loss_inputs(Wrong())
    comp = L.CompositeLoss(terms=[L.LossTerm("a", SpecLoss()), L.LossTerm("b", L.CISPOLoss())])
    assert comp.requires == L.LossInputs(actor_logprobs=True)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_soft_gate_value_and_gradient() -> None:
    # seq0: A = +1, r = 1 (tau_pos 1.0): f = (4/1) sigmoid(0) = 2, gate g = 4 s (1 - s) = 1
    # seq1: A = -1, r = 1.5 (tau_neg 1.05): s = sigmoid(1.05 * 0.5), f = (4/1.05) s
    logits, batch = uniform_batch(weights=(1.0, -1.0), action_lens=(1, 1), ratio=(1.0, 1.5))
    loss, stats = L.SAPOLoss().compute(logits, batch)
    s1 = sigmoid(1.05 * 0.5)
    # token-mean over the two action tokens: L = -(2 * 1 + (4 / 1.05) s1 * (-1)) / 2
    assert float(loss.detach()) == pytest.approx(-(2.0 - 4.0 / 1.05 * s1) / 2, rel=1e-5)
    g1 = 4 * s1 * (1 - s1)
    assert float(stats["gate_mean"]) == pytest.approx((1.0 + g1) / 2, rel=1e-5)
    assert float(stats["clip_frac"]) == 0.0  # both gates above 1/2
    assert set(stats) == set(L.SAPOLoss.stat_keys)
    loss.backward()
    # d obj / d logp = g(r) r A: REINFORCE with weights (1 * 1 * 1, g1 * 1.5 * -1)
    logits2, batch2 = uniform_batch(weights=(1.0, -g1 * 1.5), action_lens=(1, 1))
    L.ReinforceLoss().compute(logits2, batch2)[0].backward()
    assert_close(logits.grad, logits2.grad)


def test_sapo_attenuates_far_off_policy_tokens_without_a_cutoff() -> None:
    # r = 5, A = +1, tau_pos 1: s = sigmoid(4), g = 4 s (1 - s) ~ 0.07: the token still
    # passes a gradient (the clipped surrogate would pass none), 7% of the on-policy one
    logits, batch = uniform_batch(weights=(1.0,), action_lens=(1,), ratio=(5.0,))
    loss, stats = L.SAPOLoss().compute(logits, batch)
    s = sigmoid(4.0)
    assert float(loss.detach()) == pytest.approx(-4.0 * s, rel=1e-5)
    assert float(stats["clip_frac"]) == 1.0
    loss.backward()
    logits2, batch2 = uniform_batch(weights=(4 * s * (1 - s) * 5.0,), action_lens=(1,))
    L.ReinforceLoss().compute(logits2, batch2)[0].backward()
    assert_close(logits.grad, logits2.grad)
    clipped, _ = uniform_batch(weights=(1.0,), action_lens=(1,), ratio=(5.0,))
    L.TokenClippedSurrogateLoss().compute(clipped, _)[0].backward()
    assert float(clipped.grad.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="tau_neg=0"):
        L.SAPOLoss(tau_neg=0)
