"""Presets: keyword-only factories of the common RLAlgorithm compositions, and the run's
``AlgorithmSpec``.

Presets cover the common algorithms; anything else is a new composition
(libludic.training.algorithm.RLAlgorithm). ``ALGORITHMS`` maps each preset's name to its
factory; ``AlgorithmSpec`` (name, group_size, kwargs, and the optimisation options
:data:`TRAINER_OPTIONS`) is the one place a run configures its algorithm (the services read
it from the top-level ``algorithm:`` section of the run config).

Options of every RL preset (reinforce, grpo, cispo, gspo, dr_grpo, scalerl), with AReaL's
names and defaults:

- reward shaping before credit (libludic.training.rewards.RewardShaping: formula and
  order): ``overlong_reward_penalty`` (False) with ``overlong_tokens`` and
  ``overlong_penalty_factor`` (both required with the penalty; ``max_new_tokens``, the
  preset's kwarg, is the generation budget), ``reward_bias`` (0.0), ``reward_scaling`` (1.0),
  ``reward_clip`` (20.0). Items keep the task reward in ``meta["reward"]``; the credit sees
  the shaped one.
- ``dynamic_sampling`` (False; True in scalerl, where the paper calls it the zero-variance
  filter ``filter_zvp``): the preprocess ``drop_zero_variance_groups``.
- ``mask_no_eos_with_zero`` (False): after credit, weight 0 for every item whose completion
  ended without EOS (``Step.info["finish_reason"] == "length"``, the token budget).
- ``gamma``: step t weighed by G_t = sum_k gamma^k r_{t+k} (libludic.training.credit_assignment);
  reinforce 1.0, the others None (every step weighed by the episode's total reward).

The grouped presets (grpo, cispo, gspo, dr_grpo, scalerl) also take ``reward_norm`` and
``adv_norm`` (AReaL's ``NormConfig``, libludic.training.normalization). What each option
does and how it meets the services: DEVELOPERS.md, "Training" (Reward options, Dynamic
sampling, Normalisation, Per-step credit).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from libludic.training.algorithm import RLAlgorithm
from libludic.training.components import CREDIT_ASSIGNERS, LOSSES, build_component
from libludic.training.config import TrainerConfig
from libludic.training.credit_assignment import (
    ConstantCredit,
    CreditAssigner,
    GroupNormalizedReturn,
    HybridNormalizedReturn,
    MonteCarloReturn,
    NormalizedReturn,
)
from libludic.training.filters import PreprocessFn, drop_zero_variance_groups
from libludic.training.loss import (
    KL_ESTIMATORS,
    CISPOLoss,
    CompositeLoss,
    GSPOLoss,
    Loss,
    LossTerm,
    MaskedCausalLMCrossEntropyLoss,
    OffPolicyCorrection,
    ReinforceLoss,
    SAPOLoss,
    TokenClippedSurrogateLoss,
    TokenKLLoss,
)
from libludic.training.normalization import NormConfig
from libludic.training.rewards import RewardShaping
from libludic.training.schedule import check_shape


def _dynamic_sampling(dynamic_sampling: bool) -> PreprocessFn | None:
    """The preprocess of ``dynamic_sampling``: drop the groups whose (shaped) total rewards
    are all equal, whose group-centred advantage is 0 everywhere."""
    if not isinstance(dynamic_sampling, bool):
        raise ValueError(f"dynamic_sampling={dynamic_sampling!r} must be true or false")
    return drop_zero_variance_groups if dynamic_sampling else None


#: a preset's reward kwargs (module docstring), and the fields of its OffPolicyCorrection
REWARD_KEYS = (
    "dynamic_sampling",
    "reward_scaling",
    "reward_bias",
    "reward_clip",
    "overlong_reward_penalty",
    "overlong_tokens",
    "overlong_penalty_factor",
    "max_new_tokens",
    "mask_no_eos_with_zero",
)
OFF_POLICY_KEYS = tuple(f.name for f in dataclasses.fields(OffPolicyCorrection))


def _reward_options(kw: Mapping[str, Any]) -> dict[str, Any]:
    """The RLAlgorithm fields every RL preset sets from its reward kwargs (``kw``: the
    preset's arguments, its ``locals()``; module docstring)."""
    if not isinstance(kw["mask_no_eos_with_zero"], bool):
        raise ValueError(
            f"mask_no_eos_with_zero={kw['mask_no_eos_with_zero']!r} must be true or false"
        )
    shaping = {
        k: kw[k] for k in REWARD_KEYS if k not in ("dynamic_sampling", "mask_no_eos_with_zero")
    }
    return {
        "preprocess": _dynamic_sampling(kw["dynamic_sampling"]),
        "reward_shaping": RewardShaping(**shaping),
        "mask_no_eos_with_zero": kw["mask_no_eos_with_zero"],
    }


def _off_policy(kw: Mapping[str, Any]) -> OffPolicyCorrection:
    """The loss's OffPolicyCorrection from the preset's arguments (its ``locals()``)."""
    return OffPolicyCorrection(**{k: kw[k] for k in OFF_POLICY_KEYS})


NormArg = NormConfig | Mapping[str, Any] | None


def _group_credit(
    builtin: GroupNormalizedReturn | HybridNormalizedReturn,
    *,
    reward_norm: NormArg,
    adv_norm: NormArg,
    positive_only: bool = False,
) -> CreditAssigner:
    """The preset's own assigner, or NormalizedReturn when ``reward_norm`` / ``adv_norm``
    is given (``reward_norm`` unset: the preset's own normalisation as a NormConfig).

    The presets' own normalisations of the rewards: grpo, cispo, dr_grpo: group mean, no
    std; gspo and grpo with ``normalize_adv``: group mean and population std, eps 1e-8;
    scalerl: group mean, batch population std, eps 1e-8. ``reward_norm`` replaces it,
    ``adv_norm`` runs after it; leave-one-out (RLOO) is ``reward_norm: {mean_level: group,
    mean_leave1out: true, std_level: null}``."""
    if reward_norm is None and adv_norm is None:
        return builtin
    if isinstance(builtin, HybridNormalizedReturn):
        own = NormConfig("group", False, "batch", False, builtin.eps)
    else:
        own = NormConfig("group", False, "group" if builtin.normalize_adv else None, False, 1e-8)
    return NormalizedReturn(
        builtin.group_size,
        reward_norm=own if reward_norm is None else NormConfig.parse(reward_norm, "reward_norm"),
        adv_norm=None if adv_norm is None else NormConfig.parse(adv_norm, "adv_norm"),
        positive_only=positive_only,
        gamma=builtin.gamma,
    )


def _norm_with_preset_std(preset: str, normalize_adv: bool | None, reward_norm: NormArg) -> NormArg:
    """``normalize_adv`` is the std of the preset's own normalisation: one or the other."""
    if normalize_adv is not None and reward_norm is not None:
        raise ValueError(
            f"{preset}: normalize_adv={normalize_adv!r} and reward_norm both set; "
            "normalize_adv is reward_norm's std_level (group or null): give only reward_norm"
        )
    return reward_norm


def _grpo_credit(preset: str, kw: Mapping[str, Any]) -> CreditAssigner:
    """GRPO's credit from a preset's arguments (its ``locals()``): the group-centred return
    (divided by the group std with ``normalize_adv``), ``reward_norm`` / ``adv_norm``."""
    builtin = GroupNormalizedReturn(
        kw["group_size"],
        normalize_adv=bool(kw["normalize_adv"]),
        positive_only=kw["positive_only"],
        gamma=kw["gamma"],
    )
    return _group_credit(
        builtin,
        reward_norm=_norm_with_preset_std(preset, kw["normalize_adv"], kw["reward_norm"]),
        adv_norm=kw["adv_norm"],
        positive_only=kw["positive_only"],
    )


def _no_std(preset: str, name: str, cfg: NormArg) -> NormArg:
    if cfg is not None and NormConfig.parse(cfg, name).std_level is not None:
        raise ValueError(
            f"{name}.std_level must be null in {preset}: dropping the std is half of "
            "Dr. GRPO; use grpo for a std normalisation"
        )
    return cfg


def _with_kl(loss: Loss, kl_coeff: float, name: str, kl_estimator: str = "k3") -> Loss:
    """``loss`` plus ``kl_coeff`` x the KL estimate to the reference policy (TokenKLLoss:
    k1, k2 or k3, AReaL's ``kl_estimator``). The default is k3, not AReaL's k1: the estimate
    is a loss term on tokens sampled from pi, where k1's gradient, grad log pi, is zero in
    expectation, while k3's expected gradient is that of KL(ref || pi)."""
    if kl_coeff < 0:
        raise ValueError(f"kl_coeff={kl_coeff} must be >= 0")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={kl_estimator!r}; use one of {list(KL_ESTIMATORS)}")
    if kl_coeff == 0.0:
        return loss
    return CompositeLoss(
        terms=[
            LossTerm(name, loss, 1.0),
            LossTerm("kl", TokenKLLoss(estimator=kl_estimator), kl_coeff),
        ]
    )


def make_reinforce(
    *,
    gamma: float | None = 1.0,
    aggregation: str = "token-mean",
    max_new_tokens: int | None = None,
    dynamic_sampling: bool = False,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float = 20.0,
    overlong_reward_penalty: bool = False,
    overlong_tokens: int | None = None,
    overlong_penalty_factor: float | None = None,
    mask_no_eos_with_zero: bool = False,
) -> RLAlgorithm:
    """MonteCarloReturn(gamma) + ReinforceLoss: step t weighed by G_t = sum_k gamma^k
    r_{t+k} (None: by the episode's total reward).

    ``dynamic_sampling`` drops the groups (rollouts sharing ``meta.group_id``) whose total
    rewards are all equal, as in every RL preset.
    """
    reward = _reward_options(locals())
    return RLAlgorithm(
        name="reinforce",
        credit_assigner=MonteCarloReturn(gamma=gamma),
        loss=ReinforceLoss(aggregation=aggregation, max_new_tokens=max_new_tokens),
        **reward,
    )


def make_grpo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    normalize_adv: bool | None = None,
    positive_only: bool = False,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    kl_coeff: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    max_new_tokens: int | None = None,
    mismatch_correction: str | None = None,
    mismatch_level: str = "token",
    mismatch_cap: float = 2.0,
    recompute_logprob: bool = False,
    use_decoupled_loss: bool = False,
    behav_imp_weight_cap: float | None = None,
    reward_norm: NormArg = None,
    adv_norm: NormArg = None,
    dynamic_sampling: bool = False,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float = 20.0,
    overlong_reward_penalty: bool = False,
    overlong_tokens: int | None = None,
    overlong_penalty_factor: float | None = None,
    mask_no_eos_with_zero: bool = False,
) -> RLAlgorithm:
    """GroupNormalizedReturn + TokenClippedSurrogateLoss (+ the KL term when kl_coeff > 0, estimator kl_estimator).

    ``normalize_adv`` (unset: False) as in GroupNormalizedReturn: mean-centred only; True
    for the original GRPO's division by the group std. ``reward_norm`` / ``adv_norm``
    (AReaL's NormConfig, see the module docstring) replace that normalisation or add one
    after it; ``normalize_adv`` and ``reward_norm`` are exclusive. ``gamma`` (default None:
    every step weighed by the episode's total reward) turns on per-step credit (module
    docstring).

    ``dynamic_sampling`` (AReaL's and DAPO's name; default False) drops, before credit,
    every group whose rollouts all have the same total reward: its advantages are all 0.
    Every RL preset takes it (scalerl has it on by default), and the reward options of the
    module docstring.

    ``mismatch_*`` (TIS / MIS against the server's logprobs), ``recompute_logprob``,
    ``use_decoupled_loss`` and ``behav_imp_weight_cap`` (AReaL's decoupled PPO) are the
    fields of the loss's ``OffPolicyCorrection``; the cispo, scalerl, gspo and dr_grpo
    presets take them too. ``aggregation`` (and its constant ``max_new_tokens`` for
    "seq-mean-token-sum-norm") is the loss's: see libludic.training.loss.
    """
    reward = _reward_options(locals())
    off_policy = _off_policy(locals())
    loss = TokenClippedSurrogateLoss(
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        aggregation=aggregation,
        max_new_tokens=max_new_tokens,
        off_policy=off_policy,
    )
    return RLAlgorithm(
        name="grpo",
        credit_assigner=_grpo_credit("grpo", locals()),
        loss=_with_kl(loss, kl_coeff, "pg", kl_estimator),
        **reward,
    )


def make_sapo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    normalize_adv: bool | None = None,
    positive_only: bool = False,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    kl_coeff: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    max_new_tokens: int | None = None,
    mismatch_correction: str | None = None,
    mismatch_level: str = "token",
    mismatch_cap: float = 2.0,
    recompute_logprob: bool = False,
    use_decoupled_loss: bool = False,
    behav_imp_weight_cap: float | None = None,
    reward_norm: NormArg = None,
    adv_norm: NormArg = None,
    dynamic_sampling: bool = False,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float = 20.0,
    overlong_reward_penalty: bool = False,
    overlong_tokens: int | None = None,
    overlong_penalty_factor: float | None = None,
    mask_no_eos_with_zero: bool = False,
) -> RLAlgorithm:
    """SAPO: make_grpo's credit (and its options) with SAPOLoss, the soft gate of
    temperatures ``tau_pos`` / ``tau_neg`` in place of the clipped surrogate (+ the KL term
    when kl_coeff > 0)."""
    reward = _reward_options(locals())
    loss = SAPOLoss(
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        aggregation=aggregation,
        max_new_tokens=max_new_tokens,
        off_policy=_off_policy(locals()),
    )
    return RLAlgorithm(
        name="sapo",
        credit_assigner=_grpo_credit("sapo", locals()),
        loss=_with_kl(loss, kl_coeff, "pg", kl_estimator),
        **reward,
    )


def make_dapo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    normalize_adv: bool | None = None,
    positive_only: bool = False,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = 0.28,
    c_clip: float | None = None,
    kl_coeff: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    max_new_tokens: int | None = None,
    mismatch_correction: str | None = None,
    mismatch_level: str = "token",
    mismatch_cap: float = 2.0,
    recompute_logprob: bool = False,
    use_decoupled_loss: bool = False,
    behav_imp_weight_cap: float | None = None,
    reward_norm: NormArg = None,
    adv_norm: NormArg = None,
    dynamic_sampling: bool = True,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float = 20.0,
    overlong_reward_penalty: bool = True,
    overlong_tokens: int | None = None,
    overlong_penalty_factor: float | None = None,
    mask_no_eos_with_zero: bool = False,
) -> RLAlgorithm:
    """DAPO (Yu et al. 2025): make_grpo with the paper's choices as defaults: clip-higher
    (``eps_clip`` 0.2 below, ``eps_clip_higher`` 0.28 above), the token-mean loss, dynamic
    sampling (groups whose rewards are all equal dropped) and the overlong reward shaping
    (``overlong_penalty_factor``, unset: 1.0, within ``overlong_tokens`` of
    ``max_new_tokens``: both are the run's to give, the paper's 4096 of 20480), no KL term.
    Every make_grpo kwarg."""
    kw = dict(locals())
    if overlong_reward_penalty and (max_new_tokens is None or overlong_tokens is None):
        raise ValueError(
            "dapo shapes overlong completions: give max_new_tokens (the generation budget, "
            "the tasks' max_tokens) and overlong_tokens (the span before it that is penalised; "
            "DAPO: 4096 of 20480), or set overlong_reward_penalty: false"
        )
    if overlong_reward_penalty and overlong_penalty_factor is None:
        kw["overlong_penalty_factor"] = 1.0
    return dataclasses.replace(make_grpo(**kw), name="dapo")


def make_sft(*, aggregation: str = "token-mean") -> RLAlgorithm:
    """ConstantCredit(1.0) + MaskedCausalLMCrossEntropyLoss."""
    return RLAlgorithm(
        name="sft",
        credit_assigner=ConstantCredit(value=1.0),
        loss=MaskedCausalLMCrossEntropyLoss(aggregation=aggregation),
    )


def make_scalerl(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    dynamic_sampling: bool | None = None,
    filter_zvp: bool | None = None,
    positive_only: bool = False,
    eps_clip_high: float = 0.2,
    aggregation: str = "token-mean",
    max_new_tokens: int | None = None,
    mismatch_correction: str | None = None,
    mismatch_level: str = "token",
    mismatch_cap: float = 2.0,
    recompute_logprob: bool = False,
    use_decoupled_loss: bool = False,
    behav_imp_weight_cap: float | None = None,
    reward_norm: NormArg = None,
    adv_norm: NormArg = None,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float = 20.0,
    overlong_reward_penalty: bool = False,
    overlong_tokens: int | None = None,
    overlong_penalty_factor: float | None = None,
    mask_no_eos_with_zero: bool = False,
) -> RLAlgorithm:
    """HybridNormalizedReturn + CISPOLoss, with dynamic sampling on by default.

    ``reward_norm`` replaces the hybrid normalisation (group mean, batch population std,
    eps 1e-8), ``adv_norm`` adds one after it (module docstring).

    ``dynamic_sampling`` (default True here; ``filter_zvp``, the paper's "zero-variance
    filter", is the same switch and may be given instead) drops every group whose rollouts
    all have the same total reward before credit.
    """
    off_policy = _off_policy(locals())
    if dynamic_sampling is not None and filter_zvp is not None and dynamic_sampling != filter_zvp:
        raise ValueError(
            f"dynamic_sampling={dynamic_sampling!r} and filter_zvp={filter_zvp!r} are the same "
            "switch (filter_zvp is ScaleRL's name for it); give only dynamic_sampling"
        )
    zvp = next((x for x in (dynamic_sampling, filter_zvp) if x is not None), True)
    reward = _reward_options({**locals(), "dynamic_sampling": zvp})
    return RLAlgorithm(
        name="scalerl",
        credit_assigner=_group_credit(
            HybridNormalizedReturn(group_size=group_size, positive_only=positive_only, gamma=gamma),
            reward_norm=reward_norm,
            adv_norm=adv_norm,
            positive_only=positive_only,
        ),
        loss=CISPOLoss(
            eps_clip_high=eps_clip_high,
            aggregation=aggregation,
            max_new_tokens=max_new_tokens,
            off_policy=off_policy,
        ),
        **reward,
    )


def make_cispo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    kl_coeff: float = 0.0,
    kl_estimator: str = "k3",
    eps_clip_low: float | None = None,
    eps_clip_high: float = 0.2,
    aggregation: str = "token-mean",
    max_new_tokens: int | None = None,
    mismatch_correction: str | None = None,
    mismatch_level: str = "token",
    mismatch_cap: float = 2.0,
    recompute_logprob: bool = False,
    use_decoupled_loss: bool = False,
    behav_imp_weight_cap: float | None = None,
    reward_norm: NormArg = None,
    adv_norm: NormArg = None,
    dynamic_sampling: bool = False,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float = 20.0,
    overlong_reward_penalty: bool = False,
    overlong_tokens: int | None = None,
    overlong_penalty_factor: float | None = None,
    mask_no_eos_with_zero: bool = False,
) -> RLAlgorithm:
    """GroupNormalizedReturn + CISPOLoss (+ the KL term when kl_coeff > 0, estimator kl_estimator); ``reward_norm`` /
    ``adv_norm`` as in make_grpo."""
    reward = _reward_options(locals())
    off_policy = _off_policy(locals())
    loss = CISPOLoss(
        eps_clip_low=eps_clip_low,
        eps_clip_high=eps_clip_high,
        aggregation=aggregation,
        max_new_tokens=max_new_tokens,
        off_policy=off_policy,
    )
    return RLAlgorithm(
        name="cispo",
        credit_assigner=_group_credit(
            GroupNormalizedReturn(group_size=group_size, gamma=gamma),
            reward_norm=reward_norm,
            adv_norm=adv_norm,
        ),
        loss=_with_kl(loss, kl_coeff, "cispo", kl_estimator),
        **reward,
    )


def make_gspo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    normalize_adv: bool | None = None,
    positive_only: bool = False,
    eps_clip: float = 3e-4,
    eps_clip_higher: float | None = 4e-4,
    kl_coeff: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "seq-mean-token-mean",
    max_new_tokens: int | None = None,
    mismatch_correction: str | None = None,
    mismatch_level: str = "token",
    mismatch_cap: float = 2.0,
    recompute_logprob: bool = False,
    use_decoupled_loss: bool = False,
    behav_imp_weight_cap: float | None = None,
    reward_norm: NormArg = None,
    adv_norm: NormArg = None,
    dynamic_sampling: bool = False,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float = 20.0,
    overlong_reward_penalty: bool = False,
    overlong_tokens: int | None = None,
    overlong_penalty_factor: float | None = None,
    mask_no_eos_with_zero: bool = False,
) -> RLAlgorithm:
    """GSPO: GroupNormalizedReturn + GSPOLoss (+ the KL term when kl_coeff > 0, estimator kl_estimator).

    As in the GSPO paper: A_i = (R_i - mean(R)) / std(R) (``normalize_adv`` unset: True,
    unlike make_grpo's default), clipping ranges 3e-4 / 4e-4 on the sequence ratio, and one
    term per sequence (aggregation "seq-mean-token-mean"). ``reward_norm`` / ``adv_norm`` as
    in make_grpo.
    """
    reward = _reward_options(locals())
    off_policy = _off_policy(locals())
    std = True if normalize_adv is None else normalize_adv
    loss = GSPOLoss(
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        aggregation=aggregation,
        max_new_tokens=max_new_tokens,
        off_policy=off_policy,
    )
    return RLAlgorithm(
        name="gspo",
        credit_assigner=_group_credit(
            GroupNormalizedReturn(
                group_size, normalize_adv=std, positive_only=positive_only, gamma=gamma
            ),
            reward_norm=_norm_with_preset_std("gspo", normalize_adv, reward_norm),
            adv_norm=adv_norm,
            positive_only=positive_only,
        ),
        loss=_with_kl(loss, kl_coeff, "pg", kl_estimator),
        **reward,
    )


def make_dr_grpo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    kl_coeff: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "seq-mean-token-sum-norm",
    max_new_tokens: int | None = 1024,
    mismatch_correction: str | None = None,
    mismatch_level: str = "token",
    mismatch_cap: float = 2.0,
    recompute_logprob: bool = False,
    use_decoupled_loss: bool = False,
    behav_imp_weight_cap: float | None = None,
    reward_norm: NormArg = None,
    adv_norm: NormArg = None,
    dynamic_sampling: bool = False,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float = 20.0,
    overlong_reward_penalty: bool = False,
    overlong_tokens: int | None = None,
    overlong_penalty_factor: float | None = None,
    mask_no_eos_with_zero: bool = False,
) -> RLAlgorithm:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without its
    two normalisations, the std of the group's rewards and the response length.

    A_i = R_i - mean_{j in group}(R_j)    (GroupNormalizedReturn, normalize_adv=False)
    L   = -(1/N_seq) sum_i sum_t obj_it / C   (TokenClippedSurrogateLoss, aggregation
          "seq-mean-token-sum-norm"; obj as in GRPO)

    The paper's objective is (1/G) sum_i sum_t obj_it: no 1/|o_i|. Its implementation (Oat)
    divides each sequence's sum by a constant instead, the generation budget, which keeps
    the loss on GRPO's scale without a length dependence: C = ``max_new_tokens`` (AReaL's
    name for the budget; set it to the actors' ``max_tokens``). The credit has no
    normalize_adv knob: dropping the std is half of the algorithm, so ``reward_norm`` and
    ``adv_norm`` (e.g. a leave-one-out mean) must keep ``std_level: null``.
    """
    reward = _reward_options(locals())
    off_policy = _off_policy(locals())
    loss = TokenClippedSurrogateLoss(
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        aggregation=aggregation,
        max_new_tokens=max_new_tokens,
        off_policy=off_policy,
    )
    return RLAlgorithm(
        name="dr_grpo",
        credit_assigner=_group_credit(
            GroupNormalizedReturn(group_size=group_size, normalize_adv=False, gamma=gamma),
            reward_norm=_no_std("dr_grpo", "reward_norm", reward_norm),
            adv_norm=_no_std("dr_grpo", "adv_norm", adv_norm),
        ),
        loss=_with_kl(loss, kl_coeff, "pg", kl_estimator),
        **reward,
    )


def make_custom(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    credit: Any = None,
    loss: Any = None,
    dynamic_sampling: bool = False,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float = 20.0,
    overlong_reward_penalty: bool = False,
    overlong_tokens: int | None = None,
    overlong_penalty_factor: float | None = None,
    max_new_tokens: int | None = None,
    mask_no_eos_with_zero: bool = False,
) -> RLAlgorithm:
    """A credit assigner and a loss named directly instead of a preset:
    ``credit: {kind, kwargs}`` (a :data:`CREDIT_ASSIGNERS` name) and ``loss: {kind,
    kwargs}`` (a :data:`LOSSES` name; a ``CompositeLoss`` sums named terms, each ``{name,
    coeff, loss: {kind, kwargs}}``; a loss's ``off_policy`` is a mapping of
    ``OffPolicyCorrection`` fields). A credit assigner with a ``group_size`` gets the run's
    unless its kwargs set one; ``gamma`` (default None: the assigner's own default) is
    passed to the credit assigner, which must take it, and must agree with its kwargs. The
    reward options are the presets'. For example::

        algorithm:
          name: custom
          group_size: 8
          kwargs:
            credit: {kind: GroupNormalizedReturn, kwargs: {normalize_adv: true}}
            loss:
              kind: CompositeLoss
              kwargs:
                terms:
                  - {name: pg, loss: {kind: TokenClippedSurrogateLoss, kwargs: {eps_clip: 0.2}}}
                  - {name: kl, coeff: 0.01, loss: {kind: TokenKLLoss}}
    """
    reward = _reward_options(locals())
    if credit is None or loss is None:
        raise ValueError(
            "algorithm custom needs kwargs.credit and kwargs.loss, each {kind, kwargs}: "
            f"credit one of {sorted(CREDIT_ASSIGNERS)}, loss one of {sorted(LOSSES)}"
        )
    return RLAlgorithm(
        name="custom",
        credit_assigner=_custom_credit(credit, group_size, gamma),
        loss=build_component("algorithm.kwargs.loss", loss, LOSSES),
        **reward,
    )


def _custom_credit(credit: Any, group_size: int, gamma: float | None) -> CreditAssigner:
    """``credit`` built with the run's ``group_size`` and ``gamma`` (when set) as defaults;
    ``gamma`` set for an assigner that takes none, or set twice to different values, is an
    error naming the fix."""
    given = (credit.get("kwargs") or {}) if isinstance(credit, Mapping) else {}
    if gamma is not None and isinstance(given, Mapping) and given.get("gamma", gamma) != gamma:
        raise ValueError(
            f"algorithm.kwargs.gamma={gamma!r} and algorithm.kwargs.credit.kwargs.gamma="
            f"{given['gamma']!r} differ; give it once"
        )
    extra = {} if gamma is None else {"gamma": gamma}
    assigner = build_component(
        "algorithm.kwargs.credit", credit, CREDIT_ASSIGNERS, group_size=group_size, **extra
    )
    if gamma is not None and (not hasattr(assigner, "gamma") or assigner.gamma != gamma):
        raise ValueError(
            f"algorithm.kwargs.gamma={gamma!r}: the credit assigner "
            f"{type(assigner).__name__} takes no gamma (ConstantCredit reads no reward); "
            "remove it"
        )
    if not isinstance(assigner, CreditAssigner):
        raise TypeError(
            f"algorithm.kwargs.credit: {type(assigner).__name__} has no compute(rollouts): "
            "not a credit assigner (libludic.training.credit_assignment.CreditAssigner)"
        )
    return assigner


ALGORITHMS: dict[str, Callable[..., RLAlgorithm]] = {
    "reinforce": make_reinforce,
    "grpo": make_grpo,
    "sft": make_sft,
    "scalerl": make_scalerl,
    "cispo": make_cispo,
    "gspo": make_gspo,
    "dr_grpo": make_dr_grpo,
    "sapo": make_sapo,
    "dapo": make_dapo,
    "custom": make_custom,
}


#: the optimisation options of the ``algorithm:`` section: TrainerConfig fields under
#: AReaL's names (``actor.ppo_n_minibatches``, ``actor.gradient_checkpointing``,
#: ``actor.optimizer.{lr_scheduler_type, warmup_steps_proportion, min_lr_ratio}``), read by
#: the learner; their defaults are TrainerConfig's
TRAINER_OPTIONS = (
    "lr_scheduler_type",
    "warmup_steps_proportion",
    "min_lr_ratio",
    "ppo_n_minibatches",
    "gradient_checkpointing",
)
_TRAINER_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(TrainerConfig) if f.name in TRAINER_OPTIONS
}
SPEC_KEYS = ("name", "group_size", "kwargs", *TRAINER_OPTIONS)


@dataclass(frozen=True)
class AlgorithmSpec:
    """The run's algorithm, configured once: ``ALGORITHMS[name](group_size=..., **kwargs)``
    and the optimisation options of :data:`TRAINER_OPTIONS`.

    ``group_size`` is also the feeder's episodes per request and the credit worker's group
    size, so it lives here and not in ``kwargs``; presets without a group (reinforce, sft)
    ignore it in the factory. The optimisation options (the learning-rate schedule of
    libludic.training.schedule, PPO minibatches, gradient checkpointing) are the learner's
    TrainerConfig fields of the same names (``trainer_options``); the schedule's horizon is
    the learner's ``num_steps``.
    """

    name: str = "grpo"
    group_size: int = 8
    kwargs: dict[str, Any] = field(default_factory=dict)
    lr_scheduler_type: str = _TRAINER_DEFAULTS["lr_scheduler_type"]
    warmup_steps_proportion: float = _TRAINER_DEFAULTS["warmup_steps_proportion"]
    min_lr_ratio: float = _TRAINER_DEFAULTS["min_lr_ratio"]
    ppo_n_minibatches: int = _TRAINER_DEFAULTS["ppo_n_minibatches"]
    gradient_checkpointing: bool = _TRAINER_DEFAULTS["gradient_checkpointing"]

    def __post_init__(self) -> None:
        self._check_trainer_options()
        if self.name not in ALGORITHMS:
            raise ValueError(f"algorithm.name={self.name!r}; use one of {sorted(ALGORITHMS)}")
        if (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size < 1
        ):
            raise ValueError(f"algorithm.group_size={self.group_size!r} must be an integer >= 1")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"algorithm.kwargs={self.kwargs!r} must be a mapping")
        if "group_size" in self.kwargs:
            raise ValueError(
                f"algorithm.kwargs.group_size={self.kwargs['group_size']!r}: move it to "
                "algorithm.group_size (one value for feeder, credit and learner)"
            )
        params = inspect.signature(ALGORITHMS[self.name]).parameters
        misplaced = sorted(set(self.kwargs) & set(TRAINER_OPTIONS))
        if misplaced:
            raise ValueError(
                f"algorithm.kwargs {misplaced} are optimisation options, not preset arguments: "
                f"move them up one level, to algorithm.{misplaced[0]}"
            )
        unknown = sorted(set(self.kwargs) - set(params))
        if unknown:
            known = sorted(p for p in params if p != "group_size")
            raise ValueError(
                f"algorithm.kwargs {unknown} are not arguments of make_{self.name}; known: {known}"
            )
        if self.build().dynamic_sampling and self.group_size == 1:
            raise ValueError(
                f"algorithm {self.name!r} with group_size=1 and dynamic sampling drops every "
                "group (one rollout never has reward variance); set algorithm.group_size >= 2 "
                "or algorithm.kwargs.dynamic_sampling: false"
            )

    def _check_trainer_options(self) -> None:
        try:
            check_shape(self.lr_scheduler_type, self.warmup_steps_proportion, self.min_lr_ratio)
        except ValueError as e:
            raise ValueError(f"algorithm.{e}") from None
        n = self.ppo_n_minibatches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"algorithm.ppo_n_minibatches={n!r} must be an integer >= 1")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(
                f"algorithm.gradient_checkpointing={self.gradient_checkpointing!r} must be "
                "true or false"
            )

    def trainer_options(self) -> dict[str, Any]:
        """The optimisation options as TrainerConfig keyword arguments."""
        return {k: getattr(self, k) for k in TRAINER_OPTIONS}

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> AlgorithmSpec:
        """The ``algorithm:`` section ({name, group_size, kwargs} and the optimisation
        options); None/empty = defaults."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(
                f"algorithm: must be a mapping like {{name: grpo, group_size: 8, kwargs: {{}}}}, "
                f"got {d!r}"
            )
        unknown = sorted(set(d) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in the algorithm: section; known: "
                f"{', '.join(SPEC_KEYS)} (preset arguments such as kl_coeff go under kwargs)"
            )
        kw: dict[str, Any] = dict(d)
        for k in ("group_size", "ppo_n_minibatches"):
            if k in kw and isinstance(kw[k], str) and kw[k].isdigit():
                kw[k] = int(kw[k])
        if kw.get("kwargs") is None:
            kw.pop("kwargs", None)
        return cls(**kw)

    def build(self, group_size: int | None = None) -> RLAlgorithm:
        """The RLAlgorithm; ``group_size`` overrides the configured one (partial groups)."""
        factory = ALGORITHMS[self.name]
        kw = dict(self.kwargs)
        if "group_size" in inspect.signature(factory).parameters:
            kw["group_size"] = self.group_size if group_size is None else group_size
        try:
            return factory(**kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"algorithm {self.name!r} with kwargs {self.kwargs}: {e}") from e
