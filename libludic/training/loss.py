"""Losses: ``compute(logits, batch) -> (loss, stats)`` over a collated (micro-)batch.

Conventions shared by every loss here:

* Shift: ``logits[:, t]`` predicts ``input_ids[:, t+1]``. Per-token quantities live on the
  shifted grid ``[B, T-1]``: ``logp[:, t] = log pi(input_ids[:, t+1] | input_ids[:, :t+1])``
  and the token mask is ``action_mask[:, 1:] * attention_mask[:, 1:]``. ``actor_logprobs``
  / ``ref_logprobs`` are aligned to ``input_ids`` (``[B, T]``) and shifted the same way.
* ``batch["weight"]`` [B] is the CreditAssigner's weight (advantage) of each sequence.
* Aggregation (field ``aggregation``; the four modes in :func:`aggregate`): sums over action
  tokens divided by the *macro-batch* counts the Trainer puts in the batch, so the sum of
  micro-batch losses is the full-batch loss exactly (and so is its gradient).
* Behaviour policy: ``actor_logprobs`` are the logprobs the inference server returned for
  the tokens it sampled. The losses that read them (TokenClippedSurrogateLoss, CISPOLoss,
  GSPOLoss) take an :class:`OffPolicyCorrection` (field ``off_policy``) for the gap between
  that policy and the trainer's.
* Stats: detached 0-d tensors under a fixed set of keys per loss (``stat_keys``), each of
  one micro-batch. One rule combines them over micro-batches (the Trainer) and over PPO
  minibatches (``combine_minibatch_stats``), ``is_max_stat``: a key ending in ``_max`` is a
  maximum over action tokens and combines with max; every other key is a mean over action
  tokens and combines as the token-weighted mean (so both equal the full batch's value).
  Every policy-gradient loss reports ``entropy`` (:func:`token_entropy`); the ratio-based
  ones report ``ratio_mean`` / ``ratio_max``. The advantages' mean and std are the
  Trainer's step stats (``adv_mean``, ``adv_std``), not loss stats.
* Losses compute in the logits' dtype; the Trainer casts logits to fp32 first when
  ``TrainerConfig.cast_logits_to_fp32`` is set (ratios exp(logp - logp_old) need it).
* Temperature: the logits a loss receives are already divided by each item's sampling
  temperature (:func:`apply_temperature`), so ``logp`` is the logprob the server returned.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from libludic.training.compat import AGGREGATION_ALIASES, canonical_aggregation
from libludic.training.kl import KL_ESTIMATORS, KLRewardPenalty, kl_estimate
from libludic.training.typecheck import checked_loss

NUM_ACTION_TOKENS_KEY = "num_action_tokens_total"
NUM_SEQUENCES_KEY = "num_sequences_total"
WEIGHT_MEAN_KEY = "weight_mean_total"
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
MAX_STAT_SUFFIX = "_max"
# the elements (rows x V) of one chunk of token_entropy: 64 MB per fp32 temporary
ENTROPY_CHUNK_ELEMENTS = 2**24

Stats = dict[str, Tensor]


class Loss(Protocol):
    def compute(self, logits: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Stats]: ...


@dataclass(frozen=True)
class LossInputs:
    """What a loss reads beyond the logits and the collated batch, each supplied by the
    Trainer when asked: ``actor_logprobs`` (the server's logprobs of the sampled tokens,
    kept on the items), ``ref_logprobs`` (a frozen reference policy's: a KL term),
    ``prox_logprobs`` (the current weights' before the update, a no-grad forward), and
    ``pi_old_is_trained`` (pi_old is the trainer's own logprob, so with several optimizer
    steps a step the Trainer supplies ``prox_logprobs`` taken before the first), ``values``
    (a critic's, with grad, and GAE's advantages: libludic/training/value_loss.py). A loss
    declares them as ``requires``; one without it (the spec's Protocol asks only
    ``compute``) reads nothing more. ``a | b``: what either reads (a sum of losses)."""

    actor_logprobs: bool = False
    ref_logprobs: bool = False
    prox_logprobs: bool = False
    pi_old_is_trained: bool = False
    values: bool = False

    def __or__(self, other: LossInputs) -> LossInputs:
        return LossInputs(*(a or b for a, b in zip(astuple(self), astuple(other))))


NO_INPUTS = LossInputs()


@runtime_checkable
class DeclaresInputs(Protocol):
    """A loss that declares what it reads beyond the logits and the batch."""

    requires: LossInputs


@runtime_checkable
class DeclaresStats(Protocol):
    """A loss that declares the stats it returns (what the learner exports per step)."""

    stat_keys: Sequence[str]


# how a loss declared its inputs before ``requires``: refused with the new spelling
_FORMER_FLAGS = {
    "needs_actor_logprobs": "actor_logprobs",
    "needs_ref_logprobs": "ref_logprobs",
    "needs_prox_logprobs": "prox_logprobs",
    "pi_old_is_trained": "pi_old_is_trained",
}


def loss_inputs(loss: object) -> LossInputs:
    """``loss.requires``, or :data:`NO_INPUTS` for a loss that declares none. A loss that
    still declares them by the former flags (``needs_actor_logprobs = True``, ...) is
    refused with the spelling that replaces them, rather than run without its inputs."""
    requires = loss.requires if isinstance(loss, DeclaresInputs) else None
    if requires is None:
        former = [f for f in _FORMER_FLAGS if hasattr(loss, f) and getattr(loss, f)]
        if former:
            new = ", ".join(f"{_FORMER_FLAGS[f]}=True" for f in former)
            raise TypeError(
                f"{type(loss).__name__} declares {former}: a loss now declares its inputs as "
                f"`requires = LossInputs({new})` (libludic.training.loss.LossInputs)"
            )
        return NO_INPUTS
    if not isinstance(requires, LossInputs):
        raise TypeError(
            f"{type(loss).__name__}.requires is {requires!r}, not a LossInputs "
            "(libludic.training.loss.LossInputs)"
        )
    return requires


def declared_stat_keys(loss: object) -> tuple[str, ...]:
    """The stats ``loss`` declares it returns (``stat_keys``); () for one that declares none
    (the spec's Protocol asks only ``compute``): what the learner exports per step."""
    return tuple(loss.stat_keys or ()) if isinstance(loss, DeclaresStats) else ()


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """log pi(input_ids[:, t+1] | prefix) for t < T-1.   logits [B, T, V] -> [B, T-1]."""
    lg = logits[:, :-1]
    tgt = input_ids[:, 1:].unsqueeze(-1)
    return lg.gather(-1, tgt).squeeze(-1) - torch.logsumexp(lg, dim=-1)


def apply_temperature(logits: Tensor, batch: Mapping[str, Any]) -> Tensor:
    """``logits / T_b`` per sequence, T from ``batch["temperature"]`` [B] (collate fills it
    from ``SampleAttachments.train_temperature``; absent means 1). Greedy items carry 1.
    The Trainer applies it before every loss, to the policy's and the reference model's
    logits alike, so ``logp`` is the logprob under the distribution the actor sampled from,
    the same quantity the server returned as ``actor_logprobs``.

    The sampled policy at temperature T is softmax(logits / T), and vLLM (logprobs_mode
    ``processed_logprobs``) returns that policy's logprobs; the trainer must differentiate
    the same distribution or the importance ratio of an on-policy token is not 1
    (top-p/top-k truncation and penalties are not reproduced: with them the served logprob
    is that of the truncated distribution, and the ratio is 1 only on T and the full vocab).
    """
    temp = batch.get("temperature")
    if temp is None:
        return logits
    t: Tensor = temp.to(device=logits.device, dtype=logits.dtype)
    if bool((t == 1.0).all()):
        return logits
    return logits / t.view(-1, *([1] * (logits.dim() - 1)))


def token_mask(batch: Mapping[str, Any], dtype: torch.dtype) -> Tensor:
    """Action tokens on the shifted grid: [B, T-1]."""
    mask: Tensor = (batch["action_mask"][:, 1:] * batch["attention_mask"][:, 1:]).to(dtype)
    return mask


def _scalar(batch: Mapping[str, Any], key: str, default: Tensor) -> Tensor:
    v = batch.get(key)
    if v is None:
        return default
    return torch.as_tensor(v, dtype=default.dtype, device=default.device)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    batch: Mapping[str, Any],
    mode: str,
    max_new_tokens: int | None = None,
) -> Tensor:
    """Reduce [B, T-1] per-token losses to a scalar: sums over action tokens divided by a
    normaliser, with m the token mask, n_b = sum_t m_bt, N_tok = sum_b n_b,
    N_seq = #{b : n_b > 0}:

    - ``"token-mean"`` (alias ``"token"``):  L = sum_{b,t} m_bt l_bt / N_tok
    - ``"seq-mean-token-mean"`` (alias ``"sequence"``):  L = sum_b (sum_t m_bt l_bt / n_b) / N_seq
    - ``"seq-mean-token-sum"``:  L = sum_b sum_t m_bt l_bt / N_seq
    - ``"seq-mean-token-sum-norm"``:  L = sum_b sum_t m_bt l_bt / (N_seq * C), C the loss's
      ``max_new_tokens`` (Dr. GRPO: a constant, the generation budget, in place of n_b)

    N_tok / N_seq are read from ``batch[NUM_ACTION_TOKENS_KEY]`` / ``batch[NUM_SEQUENCES_KEY]``
    when present: the Trainer puts the *macro-batch* totals there, so the sum of micro-batch
    losses is the full-batch loss exactly (and so is its gradient). Without them N is the
    micro-batch's own. A sequence never spans two micro-batches, so n_b is always whole.
    """
    mode = canonical_aggregation(mode)
    if mode == "token-mean":
        n = _scalar(batch, NUM_ACTION_TOKENS_KEY, mask.sum())
        return (per_token * mask).sum() / n.clamp(min=1.0)
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation={mode!r}; use one of {AGGREGATIONS}")
    n_b = mask.sum(dim=-1)
    per_seq = (per_token * mask).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / n_b.clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        if max_new_tokens is None:
            raise ValueError(
                "aggregation='seq-mean-token-sum-norm' needs max_new_tokens (the constant C)"
            )
        per_seq = per_seq / float(max_new_tokens)
    n = _scalar(batch, NUM_SEQUENCES_KEY, (n_b > 0).sum().to(mask.dtype))
    return per_seq.sum() / n.clamp(min=1.0)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1.0)).detach()


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """max of x over the action tokens (mask > 0), detached; 0 without any (the maxima
    reported are of ratios and weights, >= 0, so an empty micro-batch never wins a max)."""
    x = x.detach().expand_as(mask)
    on = mask > 0
    top = torch.where(on, x, torch.full_like(x, -math.inf)).amax()
    return torch.where(on.any(), top, torch.zeros_like(top))


def is_max_stat(key: str) -> bool:
    """The stat combines with max over micro-batches and minibatches, not as the
    token-weighted mean (module docstring, Stats): its key ends in ``_max``."""
    return key.endswith(MAX_STAT_SUFFIX)


@torch.no_grad()
def token_entropy(
    logits: Tensor, mask: Tensor, max_elements: int = ENTROPY_CHUNK_ELEMENTS
) -> Tensor:
    """Mean over action tokens of the exact entropy of the next-token distribution:

        H_bt = -sum_v p_btv log p_btv,   p_bt = softmax(logits[b, t])   (predicts t+1)
        returns sum_{b,t} m_bt H_bt / sum_{b,t} m_bt   (0 without action tokens)

    ``mask`` [B, T-1] is ``token_mask`` (the shifted grid); the logits are the loss's, so
    already at each item's temperature. No gradient, computed in fp32. Only the action rows
    are read, ``max(1, max_elements // V)`` rows at a time: each temporary holds at most
    ``max_elements`` elements (or one row), whatever B and T; no [B, T, V] tensor is made.
    """
    b_idx, t_idx = (mask > 0).nonzero(as_tuple=True)  # [N] each: the action rows
    rows = max(1, max_elements // logits.shape[-1])
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for i in range(0, b_idx.numel(), rows):
        p = torch.softmax(logits[b_idx[i : i + rows], t_idx[i : i + rows]].float(), dim=-1)
        total += torch.special.entr(p).sum()  # entr(p) = -p log p, 0 at p = 0
    return total / max(b_idx.numel(), 1)


def _check_agg(obj: Any) -> None:
    """``obj.aggregation`` is known; the sum-norm aggregation has its constant C."""
    mode = canonical_aggregation(obj.aggregation)
    if mode not in AGGREGATIONS:
        raise ValueError(
            f"{type(obj).__name__}.aggregation={obj.aggregation!r}; use one of {AGGREGATIONS} "
            f"(or the aliases {sorted(AGGREGATION_ALIASES)})"
        )
    takes_c = hasattr(obj, "max_new_tokens")
    c = obj.max_new_tokens if takes_c else None
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise ValueError(f"{type(obj).__name__}.max_new_tokens={c!r} must be an integer >= 1")
    if mode == "seq-mean-token-sum-norm" and c is None:
        if not takes_c:
            raise ValueError(
                f"{type(obj).__name__} does not take aggregation='seq-mean-token-sum-norm' "
                "(no max_new_tokens); use another aggregation"
            )
        raise ValueError(
            f"{type(obj).__name__}.aggregation='seq-mean-token-sum-norm' needs max_new_tokens "
            "(the constant C each sequence's token sum is divided by: the generation budget)"
        )


def _old_logprobs(batch: Mapping[str, Any], who: str) -> Tensor:
    if "actor_logprobs" not in batch:
        raise KeyError(
            f"{who} needs batch['actor_logprobs']; sample with ReturnSpec.for_rl() so "
            "rollouts carry the actor's chosen-token logprobs"
        )
    old: Tensor = batch["actor_logprobs"][:, 1:]
    return old


def _ref_logprobs(batch: Mapping[str, Any], who: str) -> Tensor:
    """The reference policy's logprobs on the shifted grid [B, T-1]."""
    if batch.get("ref_logprobs") is None:
        raise KeyError(
            f"{who} needs batch['ref_logprobs']; fill SampleAttachments.ref_logprobs "
            "(reference-model logprobs aligned to input_ids) on every item, or train with "
            "the Trainer, which computes them when the loss requires ref_logprobs"
        )
    ref: Tensor = batch["ref_logprobs"][:, 1:]
    return ref


MISMATCH_CORRECTIONS = ("tis", "mis")
MISMATCH_LEVELS = ("token", "sequence")
PROX_LOGPROBS_KEY = "prox_logprobs"
ADVANTAGES_KEY = "advantages"  # [B, T-1] per token (GAE); absent: the weight of each sequence


@dataclass(frozen=True)
class OffPolicyCorrection:
    """The gap between the behaviour policy (the server's) and the trainer's policy.

    b_bt = ``actor_logprobs`` (what the inference engine sampled from). t_bt = the trainer's
    logprob of the same token under the weights the step starts from:
    ``batch["prox_logprobs"]`` (the proximal policy, recomputed by the Trainer with a
    no-grad forward before the step's first update) when the batch has them, else
    sg(logp_bt) (the same weights while a step takes one optimizer step). The Trainer puts
    them in when ``needs_prox_logprobs``, and when ``pi_old_is_trained`` and a step takes
    several optimizer steps (PPO minibatches): there sg(logp) of a later minibatch is the
    weights the earlier ones left, the ratio against it is always 1 and w would absorb the
    drift. t and b differ by the train/inference mismatch (kernels, precision, batching of
    the engine) and, for an item sampled by an older policy version, by the policy lag. Per
    action token lr_bt = t_bt - b_bt,  rho = exp(lr) = pi_t / pi_b.

    Default: the loss's pi_old is b, no weight (w = 1).

    ``recompute_logprob`` (AReaL): pi_old is the recomputed t instead of b, no weight.

    ``use_decoupled_loss`` (AReaL's decoupled PPO; implies ``recompute_logprob``): pi_old is
    the proximal policy t, and each token's term is weighted by the behaviour importance
    weight, tokens above ``behav_imp_weight_cap`` (> 1, or None: no cap) filtered out:

        r_bt = exp(logp_bt - t_bt)        the surrogate's (clipped) ratio, against pi_prox
        w_bt = rho_bt * 1[rho_bt <= behav_imp_weight_cap]     detached

    ``mismatch_correction`` "tis" / "mis" (TIS, MIS): pi_old is t, and each token's term is
    weighted by a detached w of rho, per token or per sequence (``mismatch_level``):

        level "token":     log rho_bt = lr_bt
        level "sequence":  log rho_bt = sum_s m_bs lr_bs   (the whole sequence's ratio)
        "tis" (truncated IS):  w = min(rho, mismatch_cap)
        "mis" (masked IS):     w = rho * 1[rho <= mismatch_cap]  (the token, or the whole
                               sequence, above the cap is dropped)

    The decoupled weight is token-level MIS against pi_prox, so the two do not combine.
    A dropped token adds 0 to the loss and stays in its normaliser (aggregation is
    unchanged, so micro-batch accumulation stays exact). With one optimizer step per
    batch, pi = pi_old at the forward whenever pi_old is t: r = 1 in value (gradient
    grad logp), the surrogate becomes the importance-weighted policy gradient
    -sg(w) A grad logp, and clipping acts only on weights that moved since t was taken.

    Stats (every loss that takes this reports them, whatever the options), means over
    action tokens: ``mismatch_logprob_gap`` = |t - b|; ``mismatch_kl`` = the k3 estimate
    rho - 1 - lr of KL(pi_b || pi_t) (tokens are sampled from the behaviour policy; >= 0,
    token level whatever ``mismatch_level``); ``mismatch_weight_mean`` = w, and
    ``mismatch_weight_max`` = its max over action tokens; ``mismatch_capped_frac`` = share
    of tokens truncated (tis) or dropped (mis, decoupled).
    """

    mismatch_correction: str | None = None
    mismatch_level: str = "token"
    mismatch_cap: float = 2.0
    recompute_logprob: bool = False
    use_decoupled_loss: bool = False
    behav_imp_weight_cap: float | None = None

    stat_keys: ClassVar[tuple[str, ...]] = (
        "mismatch_logprob_gap",
        "mismatch_kl",
        "mismatch_weight_mean",
        "mismatch_weight_max",
        "mismatch_capped_frac",
    )

    def __post_init__(self) -> None:
        if (
            self.mismatch_correction is not None
            and self.mismatch_correction not in MISMATCH_CORRECTIONS
        ):
            raise ValueError(
                f"mismatch_correction={self.mismatch_correction!r}; use one of "
                f"{MISMATCH_CORRECTIONS} or None"
            )
        if self.mismatch_level not in MISMATCH_LEVELS:
            raise ValueError(
                f"mismatch_level={self.mismatch_level!r}; use one of {MISMATCH_LEVELS}"
            )
        if not self.mismatch_cap >= 1.0:
            raise ValueError(f"mismatch_cap={self.mismatch_cap} must be >= 1")
        if self.behav_imp_weight_cap is not None:
            if not self.use_decoupled_loss:
                raise ValueError(
                    f"behav_imp_weight_cap={self.behav_imp_weight_cap} needs "
                    "use_decoupled_loss=True (it caps the decoupled loss's behaviour weight)"
                )
            if not self.behav_imp_weight_cap > 1.0:
                raise ValueError(f"behav_imp_weight_cap={self.behav_imp_weight_cap} must be > 1")
        if self.use_decoupled_loss and self.mismatch_correction is not None:
            raise ValueError(
                f"use_decoupled_loss=True and mismatch_correction={self.mismatch_correction!r}: "
                "the decoupled loss already weights each token by exp(prox - behav) (token-level "
                "MIS at behav_imp_weight_cap); choose one"
            )

    @property
    def needs_prox_logprobs(self) -> bool:
        """The loss reads ``batch["prox_logprobs"]`` (the Trainer then computes them)."""
        return self.recompute_logprob or self.use_decoupled_loss

    @property
    def pi_old_is_trained(self) -> bool:
        """pi_old is the trainer's own logprob t, not the behaviour's (recompute, decoupled,
        TIS/MIS): with several optimizer steps per batch the Trainer supplies t as
        ``prox_logprobs``, taken before the first."""
        return self.needs_prox_logprobs or self.mismatch_correction is not None

    @property
    def requires(self) -> LossInputs:
        """The inputs of a ratio loss that takes this correction."""
        return LossInputs(
            actor_logprobs=True,
            prox_logprobs=self.needs_prox_logprobs,
            pi_old_is_trained=self.pi_old_is_trained,
        )

    def terms(
        self, logp: Tensor, m: Tensor, batch: Mapping[str, Any], who: str
    ) -> tuple[Tensor, Tensor, Stats]:
        """(pi_old logprobs [B, T-1], the detached weight w [B, T-1], the mismatch stats)."""
        behav = _old_logprobs(batch, who).to(logp.dtype)
        prox = batch.get(PROX_LOGPROBS_KEY)
        if prox is None and self.needs_prox_logprobs:
            raise KeyError(
                f"{who} with recompute_logprob/use_decoupled_loss needs "
                f"batch[{PROX_LOGPROBS_KEY!r}] (the current weights' logprobs aligned to "
                "input_ids); the Trainer computes them when algo.needs_prox_logprobs"
            )
        trained = logp.detach() if prox is None else prox[:, 1:].to(logp.dtype)
        lr = (trained - behav) * m  # 0 off the action tokens: exp stays finite there
        mode, level, cap = self.mismatch_correction, self.mismatch_level, self.mismatch_cap
        if self.use_decoupled_loss:
            cap = math.inf if self.behav_imp_weight_cap is None else self.behav_imp_weight_cap
            mode, level = "mis", "token"
        w = torch.ones_like(lr)
        capped = torch.zeros_like(lr)
        old = trained if self.pi_old_is_trained else behav
        if mode is not None:
            log_rho = lr if level == "token" else lr.sum(-1, keepdim=True).expand_as(lr)
            log_cap = math.log(cap)
            over = log_rho > log_cap
            w = torch.exp(log_rho.clamp(max=log_cap))
            if mode == "mis":
                w = torch.where(over, torch.zeros_like(w), w)
            capped = over.to(lr.dtype)
        return (
            old,
            w,
            {
                "mismatch_logprob_gap": masked_mean(lr.abs(), m),
                "mismatch_kl": masked_mean(torch.exp(lr) - 1.0 - lr, m),
                "mismatch_weight_mean": masked_mean(w, m),
                "mismatch_weight_max": masked_max(w, m),
                "mismatch_capped_frac": masked_mean(capped, m),
            },
        )


@dataclass
class ReinforceLoss:
    """L = -agg( w_b * log pi(a_bt | s_bt) ) over action tokens.

    (The weights' mean and std are the Trainer's step stats ``adv_mean`` / ``adv_std``.)"""

    aggregation: str = "token-mean"
    max_new_tokens: int | None = None  # C of aggregation "seq-mean-token-sum-norm"
    requires: ClassVar[LossInputs] = NO_INPUTS
    stat_keys: ClassVar[tuple[str, ...]] = ("loss", "logp_mean", "entropy")

    def __post_init__(self) -> None:
        _check_agg(self)

    @checked_loss
    def compute(self, logits: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Stats]:
        logp = token_logprobs(logits, batch["input_ids"])
        m = token_mask(batch, logp.dtype)
        w = batch["weight"].to(logp.dtype).unsqueeze(-1)  # [B, 1]
        loss = aggregate(-w * logp, m, batch, self.aggregation, self.max_new_tokens)
        return loss, {
            "loss": loss.detach(),
            "logp_mean": masked_mean(logp, m),
            "entropy": token_entropy(logits, m),
        }


@dataclass
class ReinforceBaselineLoss:
    """L = -agg( (w_b - b) * log pi(a_bt | s_bt) ),  b = mean of w over the macro-batch.

    The baseline is read from ``batch[WEIGHT_MEAN_KEY]`` (set by the Trainer from the whole
    macro-batch, so micro-batching does not change it); otherwise the micro-batch mean.
    The centred advantages' mean is 0 over the macro-batch by construction, so it is no
    stat (the weights' mean and std are the Trainer's step stats ``adv_mean`` / ``adv_std``).
    """

    aggregation: str = "token-mean"
    max_new_tokens: int | None = None  # C of aggregation "seq-mean-token-sum-norm"
    requires: ClassVar[LossInputs] = NO_INPUTS
    stat_keys: ClassVar[tuple[str, ...]] = ("loss", "logp_mean", "entropy", "baseline")

    def __post_init__(self) -> None:
        _check_agg(self)

    @checked_loss
    def compute(self, logits: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Stats]:
        logp = token_logprobs(logits, batch["input_ids"])
        m = token_mask(batch, logp.dtype)
        w = batch["weight"].to(logp.dtype)
        b = _scalar(batch, WEIGHT_MEAN_KEY, w.mean())
        adv = (w - b).unsqueeze(-1)
        loss = aggregate(-adv * logp, m, batch, self.aggregation, self.max_new_tokens)
        return loss, {
            "loss": loss.detach(),
            "logp_mean": masked_mean(logp, m),
            "entropy": token_entropy(logits, m),
            "baseline": b.detach(),
        }


RATIO_STAT_KEYS = (
    "loss",
    "logp_mean",
    "entropy",
    "ratio_mean",
    "ratio_max",
    "clip_frac",
    "approx_kl",
    *OffPolicyCorrection.stat_keys,
)


def _check_eps(eps_clip: float, eps_clip_higher: float | None) -> None:
    if not 0.0 <= eps_clip < 1.0:
        raise ValueError(f"eps_clip={eps_clip} must be in [0, 1)")
    if eps_clip_higher is not None and eps_clip_higher < 0:
        raise ValueError(f"eps_clip_higher={eps_clip_higher} must be >= 0")


@dataclass
class RatioLoss:
    """What the ratio losses share (TokenClippedSurrogateLoss, CISPOLoss, GSPOLoss):
    ``L = -agg(w * obj)``, with pi_old and the detached weight w (1 unless corrected) from
    ``off_policy``, A_b = weight_b, and the stats of :data:`RATIO_STAT_KEYS`. A subclass
    gives ``objective(logp, old, adv, m) -> (obj [B, T-1], its ratio stats)``: the ratio
    (a token's, or a sequence's) and how it is clipped. With ``batch["advantages"]``
    (``ADVANTAGES_KEY``, [B, T-1]: PPO's GAE) A is per token, A_bt, instead.

    ``kl_in_reward`` (a :class:`~libludic.training.kl.KLRewardPenalty`; None: no penalty):
    the KL to the reference as a reward penalty (AReaL's ``kl_ctl``). The advantage becomes
    per token, A_bt = A_b - coeff * sum_{s >= t} m_bs k(pi_old_bs, ref_bs), detached, with
    pi_old the one ``off_policy`` chose (the behaviour's by default, as AReaL's; the
    recomputed one under ``recompute_logprob``, the decoupled loss and TIS/MIS); it needs
    ``batch["ref_logprobs"]`` and adds the stat ``kl`` (the mean k over action tokens)."""

    aggregation: str = "token-mean"
    max_new_tokens: int | None = None  # C of aggregation "seq-mean-token-sum-norm"
    off_policy: OffPolicyCorrection = field(default_factory=OffPolicyCorrection)
    kl_in_reward: KLRewardPenalty | None = None
    stat_keys: ClassVar[tuple[str, ...]] = RATIO_STAT_KEYS

    @property
    def requires(self) -> LossInputs:
        return self.off_policy.requires | LossInputs(ref_logprobs=self.kl_in_reward is not None)

    def __post_init__(self) -> None:
        _check_agg(self)
        if self.kl_in_reward is not None:
            if not isinstance(self.kl_in_reward, KLRewardPenalty):
                raise ValueError(
                    f"{type(self).__name__}.kl_in_reward={self.kl_in_reward!r}: a "
                    "KLRewardPenalty(coeff, estimator) or None"
                )
            # the class's keys are those of a loss without the penalty; this one adds its own
            keys = (*type(self).stat_keys, *KLRewardPenalty.stat_keys)
            object.__setattr__(self, "stat_keys", keys)

    def objective(self, logp: Tensor, old: Tensor, adv: Tensor, m: Tensor) -> tuple[Tensor, Stats]:
        raise NotImplementedError

    @checked_loss
    def compute(self, logits: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Stats]:
        logp = token_logprobs(logits, batch["input_ids"])
        m = token_mask(batch, logp.dtype)
        old, w, mismatch = self.off_policy.terms(logp, m, batch, type(self).__name__)
        adv = batch.get(ADVANTAGES_KEY, batch["weight"].unsqueeze(-1)).to(logp.dtype)
        kl: Stats = {}
        if self.kl_in_reward is not None:
            ref = _ref_logprobs(batch, type(self).__name__)
            adv, k = self.kl_in_reward.advantages(adv, old, ref, m)  # [B, T-1]
            kl["kl"] = masked_mean(k, m)
        obj, stats = self.objective(logp, old, adv, m)
        loss = aggregate(-w * obj, m, batch, self.aggregation, self.max_new_tokens)
        return loss, {
            "loss": loss.detach(),
            "logp_mean": masked_mean(logp, m),
            "entropy": token_entropy(logits, m),
            **stats,
            **mismatch,
            **kl,
        }


@dataclass
class TokenClippedSurrogateLoss(RatioLoss):
    """PPO/GRPO token-level clipped surrogate against pi_old (the behaviour logprobs).

    r_bt = exp(logp_bt - logp_old_bt),  A_b = weight_b
    obj  = min(r A, clip(r, 1 - eps_clip, 1 + eps_clip_higher) A)
    dual clip (``c_clip`` = c > 1): for A < 0, obj = max(obj, c A)
    L    = -agg(w * obj).   ``eps_clip_higher=None`` means symmetric (= eps_clip).

    Decoupled PPO (``off_policy.use_decoupled_loss``, AReaL), with prox = the proximal
    policy's logprobs (the current weights before the update) and b = the behaviour's:
    L = -agg( sg(v) * 1[v <= behav_imp_weight_cap] * min(r A, clip(r, 1 - eps_clip,
    1 + eps_clip_higher) A) ),  r = exp(logp - prox),  v = exp(prox - b).
    """

    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    c_clip: float | None = None
    stat_keys: ClassVar[tuple[str, ...]] = (*RATIO_STAT_KEYS, "dual_clip_frac")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_eps(self.eps_clip, self.eps_clip_higher)
        if self.c_clip is not None and self.c_clip <= 1.0:
            raise ValueError(f"c_clip={self.c_clip} must be > 1 (or None)")

    def objective(self, logp: Tensor, old: Tensor, adv: Tensor, m: Tensor) -> tuple[Tensor, Stats]:
        log_ratio = logp - old
        ratio = torch.exp(log_ratio)
        hi = 1.0 + (self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher)
        surr1 = ratio * adv
        surr2 = ratio.clamp(1.0 - self.eps_clip, hi) * adv
        obj = torch.minimum(surr1, surr2)
        dual = torch.zeros_like(obj, dtype=torch.bool)
        if self.c_clip is not None:
            floor = self.c_clip * adv
            dual = (adv < 0) & (obj < floor)
            obj = torch.where(dual, floor.expand_as(obj), obj)
        return obj, {
            "ratio_mean": masked_mean(ratio, m),
            "ratio_max": masked_max(ratio, m),
            "clip_frac": masked_mean((surr2 < surr1).to(m.dtype), m),
            "dual_clip_frac": masked_mean(dual.to(m.dtype), m),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, m),
        }


@dataclass
class CISPOLoss(RatioLoss):
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight.

    r_bt = exp(logp_bt - logp_old_bt)
    L    = -agg( w * sg(clip(r, 1 - eps_clip_low, 1 + eps_clip_high)) * A_b * logp_bt )
    ``eps_clip_low=None`` leaves the ratio unbounded below (the MiniMax-M1 setting). Unlike
    the PPO surrogate, no token's gradient is zeroed: the weight is clipped, not the update.
    """

    eps_clip_low: float | None = None
    eps_clip_high: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eps_clip_high < 0:
            raise ValueError(f"eps_clip_high={self.eps_clip_high} must be >= 0")
        if self.eps_clip_low is not None and not 0.0 <= self.eps_clip_low <= 1.0:
            raise ValueError(f"eps_clip_low={self.eps_clip_low} must be in [0, 1] or None")

    def objective(self, logp: Tensor, old: Tensor, adv: Tensor, m: Tensor) -> tuple[Tensor, Stats]:
        log_ratio = logp.detach() - old
        ratio = torch.exp(log_ratio)
        lo = 0.0 if self.eps_clip_low is None else 1.0 - self.eps_clip_low
        is_w = ratio.clamp(lo, 1.0 + self.eps_clip_high)
        return is_w * adv * logp, {
            "ratio_mean": masked_mean(ratio, m),
            "ratio_max": masked_max(ratio, m),
            "clip_frac": masked_mean((is_w != ratio).to(m.dtype), m),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, m),
        }


@dataclass
class GSPOLoss(RatioLoss):
    """GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): the clipped surrogate
    on a length-normalised sequence-level ratio.

    s_b   = exp( (1/n_b) sum_t m_bt (logp_bt - logp_old_bt) ),   A_b = weight_b
    obj_b = min(s_b A_b, clip(s_b, 1 - eps_clip, 1 + eps_clip_higher) A_b)
    L     = -agg(w * obj_b)   (obj_b on every action token of b)

    The default aggregation "seq-mean-token-mean" gives the paper's -(1/G) sum_i obj_i.
    grad s_b = s_b (1/n_b) sum_t grad logp_bt: a sequence's tokens share one weight, and a
    clipped sequence passes no gradient. Clipping ranges default to the paper's 3e-4 (left)
    and 4e-4 (right): s is a geometric mean over tokens, far closer to 1 than a token ratio.
    ``ratio_max`` is of the sequence ratios s_b; ``approx_kl`` per token.
    """

    aggregation: str = "seq-mean-token-mean"
    eps_clip: float = 3e-4
    eps_clip_higher: float | None = 4e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_eps(self.eps_clip, self.eps_clip_higher)

    def objective(self, logp: Tensor, old: Tensor, adv: Tensor, m: Tensor) -> tuple[Tensor, Stats]:
        log_ratio = (logp - old) * m
        seq_log_ratio = log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        ratio = torch.exp(seq_log_ratio)  # [B, 1]
        hi = 1.0 + (self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher)
        surr1 = ratio * adv
        surr2 = ratio.clamp(1.0 - self.eps_clip, hi) * adv
        tok_ratio = torch.exp(log_ratio.detach())
        return torch.minimum(surr1, surr2).expand_as(logp), {
            "ratio_mean": masked_mean(ratio.expand_as(m), m),
            "ratio_max": masked_max(ratio, m),
            "clip_frac": masked_mean((surr2 < surr1).to(m.dtype).expand_as(m), m),
            "approx_kl": masked_mean(tok_ratio - 1.0 - log_ratio.detach(), m),
        }


@dataclass
class SAPOLoss(RatioLoss):
    """SAPO (Gao et al. 2025, Soft Adaptive Policy Optimization, arXiv 2511.20347): a
    smooth, temperature-controlled gate on the token ratio instead of the hard clip.

    r_bt = exp(logp_bt - logp_old_bt),   A_b = weight_b,   tau = tau_pos if A_b > 0 else tau_neg
    obj  = f(r) A,   f(r) = (4 / tau) sigmoid(tau (r - 1))
    L    = -agg(w * obj)

    d obj / d logp = g(r) r A with the gate g(r) = 4 sigmoid(tau (r - 1)) (1 - sigmoid(...)):
    1 at r = 1 (the on-policy gradient), decaying smoothly as r leaves 1, the faster the
    larger tau; no token's gradient is cut off at a band's edge. ``tau_neg`` > ``tau_pos``
    damps the negative-advantage tokens more (the paper: their updates destabilise training
    more). Defaults 1.0 and 1.05 (Trinity-RFT's and TorchForge's SAPO). ``clip_frac`` is the
    fraction of tokens the gate attenuates by more than half (g < 1/2); ``gate_mean`` the
    mean of g.
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    stat_keys: ClassVar[tuple[str, ...]] = (*RATIO_STAT_KEYS, "gate_mean")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tau_pos", "tau_neg"):
            tau = getattr(self, name)
            if isinstance(tau, bool) or not isinstance(tau, int | float) or not tau > 0:
                raise ValueError(f"{name}={tau!r} must be a number > 0")

    def objective(self, logp: Tensor, old: Tensor, adv: Tensor, m: Tensor) -> tuple[Tensor, Stats]:
        log_ratio = logp - old
        ratio = torch.exp(log_ratio)
        tau = torch.where(adv > 0, self.tau_pos, self.tau_neg).to(logp.dtype)
        s = torch.sigmoid(tau * (ratio - 1.0))
        gate = (4.0 * s * (1.0 - s)).detach()
        return (4.0 / tau) * s * adv, {
            "ratio_mean": masked_mean(ratio, m),
            "ratio_max": masked_max(ratio, m),
            "clip_frac": masked_mean((gate < 0.5).to(m.dtype), m),
            "gate_mean": masked_mean(gate, m),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, m),
        }


@dataclass
class TokenKLLoss:
    """coeff * agg(KL estimate) of pi against a reference policy, per action token.

    With lr = logp_ref - logp (Schulman's estimators of KL(pi || ref), libludic.training.kl):
    k1 = -lr,   k2 = lr^2 / 2,   k3 = exp(lr) - 1 - lr  (unbiased, always >= 0).
    Needs ``batch["ref_logprobs"]`` [B, T] (SampleAttachments.ref_logprobs, or computed by
    the Trainer's frozen reference policy: ``requires.ref_logprobs``).
    """

    coeff: float = 1.0
    estimator: str = "k3"
    aggregation: str = "token-mean"
    requires: ClassVar[LossInputs] = LossInputs(ref_logprobs=True)
    stat_keys: ClassVar[tuple[str, ...]] = ("loss", "kl")

    def __post_init__(self) -> None:
        _check_agg(self)
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"estimator={self.estimator!r}; use one of {KL_ESTIMATORS}")

    @checked_loss
    def compute(self, logits: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Stats]:
        ref = _ref_logprobs(batch, "TokenKLLoss")
        logp = token_logprobs(logits, batch["input_ids"])
        m = token_mask(batch, logp.dtype)
        kl = kl_estimate(logp, ref.to(logp.dtype), self.estimator)
        loss = self.coeff * aggregate(kl, m, batch, self.aggregation)
        return loss, {"loss": loss.detach(), "kl": masked_mean(kl, m)}


@dataclass
class MaskedCausalLMCrossEntropyLoss:
    """SFT negative log-likelihood of the action tokens: L = agg(-logp). Ignores weight."""

    aggregation: str = "token-mean"
    requires: ClassVar[LossInputs] = NO_INPUTS
    stat_keys: ClassVar[tuple[str, ...]] = ("loss", "nll", "token_accuracy")

    def __post_init__(self) -> None:
        _check_agg(self)

    @checked_loss
    def compute(self, logits: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Stats]:
        logp = token_logprobs(logits, batch["input_ids"])
        m = token_mask(batch, logp.dtype)
        loss = aggregate(-logp, m, batch, self.aggregation)
        hit = (logits[:, :-1].argmax(-1) == batch["input_ids"][:, 1:]).to(m.dtype)
        return loss, {
            "loss": loss.detach(),
            "nll": masked_mean(-logp, m),
            "token_accuracy": masked_mean(hit, m),
        }


@dataclass
class LossTerm:
    name: str
    loss: Loss
    coeff: float = 1.0


@dataclass
class CompositeLoss:
    """L = sum_i coeff_i * L_i. Stats: ``loss`` plus ``{name}/{key}`` of every term."""

    terms: Sequence[LossTerm]

    def __post_init__(self) -> None:
        if not self.terms:
            raise ValueError("CompositeLoss needs at least one LossTerm")
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"CompositeLoss term names must be unique, got {names}")

    @property
    def requires(self) -> LossInputs:
        out = NO_INPUTS
        for t in self.terms:
            out = out | loss_inputs(t.loss)
        return out

    @property
    def stat_keys(self) -> tuple[str, ...]:
        keys = ["loss"]
        for t in self.terms:
            # the built-in losses declare theirs; a user's Loss needs only compute()
            keys += [f"{t.name}/{k}" for k in declared_stat_keys(t.loss)]
        return tuple(keys)

    @checked_loss
    def compute(self, logits: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Stats]:
        total: Tensor | None = None
        stats: Stats = {}
        for t in self.terms:
            li, si = t.loss.compute(logits, batch)
            total = t.coeff * li if total is None else total + t.coeff * li
            stats.update({f"{t.name}/{k}": v for k, v in si.items()})
        assert total is not None
        stats["loss"] = total.detach()
        return total, stats
