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
``adv_norm`` (AReaL's NormConfig, libludic.training.normalization). What each option
does and how it meets the services: DEVELOPERS.md, "Training" (Reward options, Dynamic
sampling, Normalisation, Per-step credit, PPO with a critic).

``ppo`` is PPO with a critic: its advantages are not credit's but the Trainer's, GAE over a
value model it trains beside the policy; its ``gamma`` is GAE's per-token discount (1.0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Unpack

from libludic.training.algorithm import RLAlgorithm
from libludic.training.components import make_custom
from libludic.training.credit_assignment import (
    ConstantCredit,
    HybridNormalizedReturn,
    MonteCarloReturn,
    StepReward,
)
from libludic.training.gae import GAE
from libludic.training.loss import (
    CISPOLoss,
    CompositeLoss,
    GSPOLoss,
    LossTerm,
    MaskedCausalLMCrossEntropyLoss,
    ReinforceLoss,
    SAPOLoss,
    TokenClippedSurrogateLoss,
)
from libludic.training.preset_options import (
    GroupOptions,
    LossOptions,
    OffPolicyOptions,
    PolicyGradientOptions,
    PresetOptions,
)
from libludic.training.value_loss import ClippedValueLoss


def make_reinforce(*, gamma: float | None = 1.0, **options: Unpack[LossOptions]) -> RLAlgorithm:
    """MonteCarloReturn(gamma) + ReinforceLoss: step t weighed by G_t = sum_k gamma^k
    r_{t+k} (None: by the episode's total reward). The reward options and ``aggregation``
    (module docstring); ``dynamic_sampling`` drops the groups (rollouts sharing
    ``meta.group_id``) whose total rewards are all equal, as in every RL preset."""
    o = PresetOptions.parse("reinforce", options, LossOptions)
    return RLAlgorithm(
        name="reinforce",
        credit_assigner=MonteCarloReturn(gamma=gamma),
        loss=ReinforceLoss(**o.shape()),
        **o.reward(),
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
    **options: Unpack[PolicyGradientOptions],
) -> RLAlgorithm:
    """GroupNormalizedReturn + TokenClippedSurrogateLoss (+ the KL term when ``kl_coeff`` >
    0, estimator ``kl_estimator``; with ``kl_in_reward`` a penalty on the reward instead).

    ``normalize_adv`` (unset: False) as in GroupNormalizedReturn: mean-centred only; True
    for the original GRPO's division by the group std. ``reward_norm`` / ``adv_norm``
    (AReaL's NormConfig) replace that normalisation or add one after it; ``normalize_adv``
    and ``reward_norm`` are exclusive. ``gamma`` (default None: every step weighed by the
    episode's total reward) turns on per-step credit.

    The options (:class:`~libludic.training.preset_options.PolicyGradientOptions`): the
    reward options of the module docstring, ``dynamic_sampling`` (AReaL's and DAPO's name;
    default False: drops, before credit, every group whose rollouts all have the same total
    reward), ``mismatch_*`` (TIS / MIS against the server's logprobs),
    ``recompute_logprob``, ``use_decoupled_loss`` and ``behav_imp_weight_cap`` (AReaL's
    decoupled PPO: the loss's ``OffPolicyCorrection``), ``aggregation`` (and its constant
    ``max_new_tokens`` for "seq-mean-token-sum-norm": libludic.training.loss), ``kl_coeff``
    (0.0: no KL), ``kl_estimator`` (k1, k2 or k3; default k3) and ``kl_in_reward`` (default
    False: the KL is a loss term, kl_coeff x TokenKLLoss; True: AReaL's ``kl_ctl``, no loss
    term, each action token's reward loses kl_coeff x its KL estimate at pi_old, so the
    advantage of token t becomes A - kl_coeff * sum_{s >= t} k_s, detached:
    PresetOptions.with_kl, libludic.training.kl). The cispo, gspo, dr_grpo, sapo and dapo
    presets take the same; scalerl all but the KL.
    """
    o = PresetOptions.parse("grpo", options, PolicyGradientOptions)
    loss = TokenClippedSurrogateLoss(
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        off_policy=o.off_policy,
        **o.shape(),
    )
    return RLAlgorithm(
        name="grpo",
        credit_assigner=o.grpo_credit("grpo", group_size, gamma, normalize_adv, positive_only),
        loss=o.with_kl(loss, "pg"),
        **o.reward(),
    )


def make_sapo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    normalize_adv: bool | None = None,
    positive_only: bool = False,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **options: Unpack[PolicyGradientOptions],
) -> RLAlgorithm:
    """SAPO: make_grpo's credit (and its options) with SAPOLoss, the soft gate of
    temperatures ``tau_pos`` / ``tau_neg`` in place of the clipped surrogate (+ the KL term
    when kl_coeff > 0, or the reward penalty with kl_in_reward)."""
    o = PresetOptions.parse("sapo", options, PolicyGradientOptions)
    loss = SAPOLoss(tau_pos=tau_pos, tau_neg=tau_neg, off_policy=o.off_policy, **o.shape())
    return RLAlgorithm(
        name="sapo",
        credit_assigner=o.grpo_credit("sapo", group_size, gamma, normalize_adv, positive_only),
        loss=o.with_kl(loss, "pg"),
        **o.reward(),
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
    **options: Unpack[PolicyGradientOptions],
) -> RLAlgorithm:
    """DAPO (Yu et al. 2025): make_grpo with the paper's choices as defaults: clip-higher
    (``eps_clip`` 0.2 below, ``eps_clip_higher`` 0.28 above), the token-mean loss, dynamic
    sampling (``dynamic_sampling`` unset: True; groups whose rewards are all equal dropped)
    and the overlong reward shaping (``overlong_reward_penalty`` unset: True;
    ``overlong_penalty_factor``, unset: 1.0, within ``overlong_tokens`` of
    ``max_new_tokens``: both are the run's to give, the paper's 4096 of 20480), no KL term.
    Every make_grpo option."""
    kw: dict[str, Any] = {"dynamic_sampling": True, "overlong_reward_penalty": True, **options}
    if kw["overlong_reward_penalty"]:
        if kw.get("max_new_tokens") is None or kw.get("overlong_tokens") is None:
            raise ValueError(
                "dapo shapes overlong completions: give max_new_tokens (the generation budget, "
                "the tasks' max_tokens) and overlong_tokens (the span before it that is "
                "penalised; DAPO: 4096 of 20480), or set overlong_reward_penalty: false"
            )
        if kw.get("overlong_penalty_factor") is None:
            kw["overlong_penalty_factor"] = 1.0
    algo = make_grpo(
        group_size=group_size,
        gamma=gamma,
        normalize_adv=normalize_adv,
        positive_only=positive_only,
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        **kw,
    )
    return dataclasses.replace(algo, name="dapo")


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
    filter_zvp: bool | None = None,
    positive_only: bool = False,
    eps_clip_high: float = 0.2,
    **options: Unpack[GroupOptions],
) -> RLAlgorithm:
    """HybridNormalizedReturn + CISPOLoss, with dynamic sampling on by default; make_grpo's
    options but the KL term.

    ``reward_norm`` replaces the hybrid normalisation (group mean, batch population std,
    eps 1e-8), ``adv_norm`` adds one after it.

    ``dynamic_sampling`` (default True here; ``filter_zvp``, the paper's "zero-variance
    filter", is the same switch and may be given instead) drops every group whose rollouts
    all have the same total reward before credit.
    """
    given = options.get("dynamic_sampling")
    if given is not None and filter_zvp is not None and given != filter_zvp:
        raise ValueError(
            f"dynamic_sampling={given!r} and filter_zvp={filter_zvp!r} are the same "
            "switch (filter_zvp is ScaleRL's name for it); give only dynamic_sampling"
        )
    zvp = next((x for x in (given, filter_zvp) if x is not None), True)
    o = PresetOptions.parse("scalerl", {**options, "dynamic_sampling": zvp}, GroupOptions)
    builtin = HybridNormalizedReturn(
        group_size=group_size, positive_only=positive_only, gamma=gamma
    )
    return RLAlgorithm(
        name="scalerl",
        credit_assigner=o.group_credit(builtin, positive_only),
        loss=CISPOLoss(eps_clip_high=eps_clip_high, off_policy=o.off_policy, **o.shape()),
        **o.reward(),
    )


def make_cispo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    eps_clip_low: float | None = None,
    eps_clip_high: float = 0.2,
    **options: Unpack[PolicyGradientOptions],
) -> RLAlgorithm:
    """GroupNormalizedReturn + CISPOLoss (+ the KL term when kl_coeff > 0, estimator
    kl_estimator, or the reward penalty with kl_in_reward); make_grpo's options."""
    o = PresetOptions.parse("cispo", options, PolicyGradientOptions)
    loss = CISPOLoss(
        eps_clip_low=eps_clip_low, eps_clip_high=eps_clip_high, off_policy=o.off_policy, **o.shape()
    )
    return RLAlgorithm(
        name="cispo",
        credit_assigner=o.grpo_credit("cispo", group_size, gamma, None, False),
        loss=o.with_kl(loss, "cispo"),
        **o.reward(),
    )


def make_gspo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    normalize_adv: bool | None = None,
    positive_only: bool = False,
    eps_clip: float = 3e-4,
    eps_clip_higher: float | None = 4e-4,
    **options: Unpack[PolicyGradientOptions],
) -> RLAlgorithm:
    """GSPO: GroupNormalizedReturn + GSPOLoss (+ the KL term when kl_coeff > 0, estimator
    kl_estimator, or the reward penalty with kl_in_reward); make_grpo's options.

    As in the GSPO paper: A_i = (R_i - mean(R)) / std(R) (``normalize_adv`` unset: True,
    unlike make_grpo's default), clipping ranges 3e-4 / 4e-4 on the sequence ratio, and one
    term per sequence (``aggregation`` default "seq-mean-token-mean").
    """
    o = PresetOptions.parse(
        "gspo", options, PolicyGradientOptions, aggregation="seq-mean-token-mean"
    )
    loss = GSPOLoss(
        eps_clip=eps_clip, eps_clip_higher=eps_clip_higher, off_policy=o.off_policy, **o.shape()
    )
    credit = o.grpo_credit("gspo", group_size, gamma, normalize_adv, positive_only, True)
    return RLAlgorithm(
        name="gspo", credit_assigner=credit, loss=o.with_kl(loss, "pg"), **o.reward()
    )


def make_dr_grpo(
    *,
    group_size: int = 8,
    gamma: float | None = None,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    **options: Unpack[PolicyGradientOptions],
) -> RLAlgorithm:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without its
    two normalisations, the std of the group's rewards and the response length.

    A_i = R_i - mean_{j in group}(R_j)    (GroupNormalizedReturn, normalize_adv=False)
    L   = -(1/N_seq) sum_i sum_t obj_it / C   (TokenClippedSurrogateLoss, aggregation
          "seq-mean-token-sum-norm", the default here; obj as in GRPO)

    The paper's objective is (1/G) sum_i sum_t obj_it: no 1/|o_i|. Its implementation (Oat)
    divides each sequence's sum by a constant instead, the generation budget, which keeps
    the loss on GRPO's scale without a length dependence: C = ``max_new_tokens`` (default
    1024 here; AReaL's name for the budget; set it to the actors' ``max_tokens``). The
    credit has no normalize_adv knob: dropping the std is half of the algorithm, so
    ``reward_norm`` and ``adv_norm`` (e.g. a leave-one-out mean) must keep ``std_level:
    null``. make_grpo's options.
    """
    o = PresetOptions.parse(
        "dr_grpo",
        options,
        PolicyGradientOptions,
        aggregation="seq-mean-token-sum-norm",
        max_new_tokens=1024,
    )
    o.without_std("dr_grpo")
    loss = TokenClippedSurrogateLoss(
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        off_policy=o.off_policy,
        **o.shape(),
    )
    return RLAlgorithm(
        name="dr_grpo",
        credit_assigner=o.grpo_credit("dr_grpo", group_size, gamma, None, False),
        loss=o.with_kl(loss, "pg"),
        **o.reward(),
    )


def make_ppo(
    *,
    gamma: float = 1.0,
    gae_lambda: float = 1.0,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    value_eps_clip: float | None = 0.5,
    **options: Unpack[OffPolicyOptions],
) -> RLAlgorithm:
    """PPO with a critic (AReaL's PPO with ``critic``): StepReward credit (each item's weight
    is its step's shaped reward), per-token advantages by GAE over a value model the Trainer
    trains beside the policy (libludic/training/gae.py, critic.py), and the loss

        L = L_pg + L_value
        L_pg    = TokenClippedSurrogateLoss on A_t (``eps_clip``, ``eps_clip_higher``,
                  ``c_clip`` as in make_grpo, the off-policy options too)
        L_value = ClippedValueLoss(``value_eps_clip``; AReaL's critic ``eps_clip``, 0.5;
                  None: unclipped) against the returns R_t = A_t + V_old(s_t)

    ``gamma`` (AReaL's ``discount``) and ``gae_lambda``: GAE's, per action token, in [0, 1],
    AReaL's defaults 1.0 and 1.0. The critic's gradient reaches only the critic, which has
    its own optimizer: what weighs its updates is its learning rate
    (``TrainerConfig.critic_lr``, default the policy's), not a loss coefficient. No
    ``group_size`` (nothing is normalised over a group: the critic is the baseline), no
    ``reward_norm`` / ``adv_norm``, no KL yet; ``mask_no_eos_with_zero`` is refused (it
    would zero a reward, not mask a loss). The reward options, ``dynamic_sampling`` and
    ``aggregation`` (both losses) are every preset's.
    """
    if options.get("mask_no_eos_with_zero"):
        raise ValueError(
            "ppo does not take mask_no_eos_with_zero: its weights are step rewards, and the "
            "mask would make a truncated completion's reward 0 rather than leave it out of "
            "the loss; leave it false"
        )
    o = PresetOptions.parse("ppo", options, OffPolicyOptions)
    policy = TokenClippedSurrogateLoss(
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        off_policy=o.off_policy,
        **o.shape(),
    )
    value = ClippedValueLoss(value_eps_clip=value_eps_clip, **o.shape())
    return RLAlgorithm(
        name="ppo",
        credit_assigner=StepReward(),
        loss=CompositeLoss(terms=[LossTerm("pg", policy), LossTerm("value", value)]),
        gae=GAE(gamma=gamma, gae_lambda=gae_lambda),
        **o.reward(),
    )


#: every preset by name (``algorithm.name``); the run's algorithm is libludic/training/algorithm_spec.py's ``AlgorithmSpec``
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
    "ppo": make_ppo,
    "custom": make_custom,
}
