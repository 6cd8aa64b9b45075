"""The options the presets share, as option objects: what a preset's ``**options`` may hold
(the ``TypedDict`` groups), their defaults (:class:`PresetOptions`, built from the
library's own ``RewardShaping`` and ``OffPolicyCorrection``), and the parts every preset
composes from them (the reward fields of an ``RLAlgorithm``, the KL term, the normalised
group credit). libludic/training/presets.py documents what each option does."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from libludic.training.credit_assignment import (
    CreditAssigner,
    GroupNormalizedReturn,
    HybridNormalizedReturn,
    NormalizedReturn,
)
from libludic.training.filters import drop_zero_variance_groups
from libludic.training.kl import KL_ESTIMATORS, KLRewardPenalty
from libludic.training.loss import (
    CompositeLoss,
    Loss,
    LossTerm,
    OffPolicyCorrection,
    RatioLoss,
    TokenKLLoss,
)
from libludic.training.normalization import NormConfig
from libludic.training.rewards import RewardShaping

NormArg = NormConfig | Mapping[str, Any] | None


class RewardOptions(TypedDict, total=False):
    """Every RL preset's reward options (presets.py's module docstring)."""

    dynamic_sampling: bool
    reward_scaling: float
    reward_bias: float
    reward_clip: float
    overlong_reward_penalty: bool
    overlong_tokens: int | None
    overlong_penalty_factor: float | None
    max_new_tokens: int | None
    mask_no_eos_with_zero: bool


class LossOptions(RewardOptions, total=False):
    """A preset's loss aggregation (libludic.training.loss; ``max_new_tokens`` is its C)."""

    aggregation: str


class OffPolicyOptions(LossOptions, total=False):
    """The ratio losses' off-policy correction (``OffPolicyCorrection``); make_ppo's options."""

    mismatch_correction: str | None
    mismatch_level: str
    mismatch_cap: float
    recompute_logprob: bool
    use_decoupled_loss: bool
    behav_imp_weight_cap: float | None


class GroupOptions(OffPolicyOptions, total=False):
    """The grouped presets' normalisation, beside the ratio losses' off-policy correction."""

    reward_norm: NormArg
    adv_norm: NormArg


class PolicyGradientOptions(GroupOptions, total=False):
    """The KL to the reference policy, for the presets that take one: a loss term, or with
    ``kl_in_reward`` a penalty on the reward (:meth:`PresetOptions.with_kl`)."""

    kl_coeff: float
    kl_estimator: str
    kl_in_reward: bool


SHAPING_KEYS = tuple(f.name for f in dataclasses.fields(RewardShaping))
OFF_POLICY_KEYS = tuple(f.name for f in dataclasses.fields(OffPolicyCorrection))


def option_keys(group: type) -> frozenset[str]:
    """The keys of an options ``TypedDict`` (its bases' included)."""
    return frozenset(typing.get_type_hints(group))


def preset_arguments(factory: Callable[..., Any]) -> frozenset[str]:
    """The keyword arguments a preset takes: its named parameters and the keys of the
    ``TypedDict`` its ``**options`` unpacks."""
    params = inspect.signature(factory).parameters
    names = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
    for n, p in params.items():
        if p.kind is p.VAR_KEYWORD:
            hint = typing.get_type_hints(factory, include_extras=True)[n]
            (group,) = typing.get_args(hint)  # Unpack[Group]
            names |= option_keys(group)
    return frozenset(names)


@dataclass(frozen=True)
class PresetOptions:
    """One preset's options with their defaults: the reward shaping and the off-policy
    correction are the library's own dataclasses (their defaults are these options')."""

    shaping: RewardShaping
    off_policy: OffPolicyCorrection
    dynamic_sampling: bool = False
    mask_no_eos_with_zero: bool = False
    aggregation: str = "token-mean"
    kl_coeff: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    reward_norm: NormArg = None
    adv_norm: NormArg = None

    @classmethod
    def parse(
        cls, preset: str, given: Mapping[str, Any], group: type, **defaults: Any
    ) -> PresetOptions:
        """``given`` (a preset's ``**options``) over the preset's ``defaults``; a key that
        is not in ``group`` is refused as Python refuses an unknown keyword argument."""
        unknown = sorted(set(given) - option_keys(group))
        if unknown:
            raise TypeError(
                f"make_{preset}() got unexpected keyword argument(s) {unknown}; its options: "
                f"{sorted(option_keys(group))}"
            )
        kw = {**defaults, **given}
        shaping = RewardShaping(**{k: kw.pop(k) for k in SHAPING_KEYS if k in kw})
        off_policy = OffPolicyCorrection(**{k: kw.pop(k) for k in OFF_POLICY_KEYS if k in kw})
        return cls(shaping, off_policy, **kw)

    def __post_init__(self) -> None:
        for name in ("dynamic_sampling", "mask_no_eos_with_zero", "kl_in_reward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.kl_coeff < 0:
            raise ValueError(f"kl_coeff={self.kl_coeff} must be >= 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator={self.kl_estimator!r}; use one of {list(KL_ESTIMATORS)}"
            )
        if self.kl_in_reward and self.kl_coeff == 0.0:
            raise ValueError(
                "kl_in_reward=true with kl_coeff=0.0 penalises nothing: set kl_coeff > 0 (the "
                "penalty's weight, AReaL's kl_ctl) or drop kl_in_reward"
            )

    @property
    def max_new_tokens(self) -> int | None:
        """The generation budget: the overlong penalty's and the loss aggregation's C."""
        return self.shaping.max_new_tokens

    def shape(self) -> dict[str, Any]:
        """The loss's aggregation keyword arguments."""
        return {"aggregation": self.aggregation, "max_new_tokens": self.max_new_tokens}

    def reward(self) -> dict[str, Any]:
        """The ``RLAlgorithm`` fields of the reward options: the dynamic-sampling
        preprocess (drops the groups whose shaped total rewards are all equal, whose
        group-centred advantage is 0 everywhere), the reward shaping and the no-EOS mask."""
        return {
            "preprocess": drop_zero_variance_groups if self.dynamic_sampling else None,
            "reward_shaping": self.shaping,
            "mask_no_eos_with_zero": self.mask_no_eos_with_zero,
        }

    def with_kl(self, loss: RatioLoss, name: str) -> Loss:
        """``loss`` plus ``kl_coeff`` x the KL estimate to the reference policy (TokenKLLoss:
        k1, k2 or k3, AReaL's ``kl_estimator``). The default is k3, not AReaL's k1: the
        estimate is a loss term on tokens sampled from pi, where k1's gradient, grad log pi,
        is zero in expectation, while k3's expected gradient is that of KL(ref || pi).

        ``kl_in_reward``: no loss term; ``loss`` itself takes the KL off the reward (AReaL's
        ``kl_ctl``; RatioLoss.kl_in_reward): A_bt = A_b - kl_coeff * sum_{s >= t} k_bs, k the
        estimate at pi_old, detached (there k1 is as good as any: it is not differentiated)."""
        if self.kl_coeff == 0.0:
            return loss
        if self.kl_in_reward:
            penalty = KLRewardPenalty(self.kl_coeff, self.kl_estimator)
            return dataclasses.replace(loss, kl_in_reward=penalty)
        return CompositeLoss(
            terms=[
                LossTerm(name, loss, 1.0),
                LossTerm("kl", TokenKLLoss(estimator=self.kl_estimator), self.kl_coeff),
            ]
        )

    def group_credit(
        self,
        builtin: GroupNormalizedReturn | HybridNormalizedReturn,
        positive_only: bool = False,
        reward_norm: NormArg = None,
    ) -> CreditAssigner:
        """The preset's own assigner, or NormalizedReturn when ``reward_norm`` /
        ``adv_norm`` is given (``reward_norm`` unset: the preset's own normalisation as a
        NormConfig). ``reward_norm``: this preset's checked value (default: the option).

        The presets' own normalisations of the rewards: grpo, cispo, dr_grpo: group mean, no
        std; gspo and grpo with ``normalize_adv``: group mean and population std, eps 1e-8;
        scalerl: group mean, batch population std, eps 1e-8. ``reward_norm`` replaces it,
        ``adv_norm`` runs after it; leave-one-out (RLOO) is ``reward_norm: {mean_level: group,
        mean_leave1out: true, std_level: null}``."""
        reward_norm = self.reward_norm if reward_norm is None else reward_norm
        if reward_norm is None and self.adv_norm is None:
            return builtin
        if isinstance(builtin, HybridNormalizedReturn):
            own = NormConfig("group", False, "batch", False, builtin.eps)
        else:
            std = "group" if builtin.normalize_adv else None
            own = NormConfig("group", False, std, False, 1e-8)
        return NormalizedReturn(
            builtin.group_size,
            reward_norm=own
            if reward_norm is None
            else NormConfig.parse(reward_norm, "reward_norm"),
            adv_norm=None if self.adv_norm is None else NormConfig.parse(self.adv_norm, "adv_norm"),
            positive_only=positive_only,
            gamma=builtin.gamma,
        )

    def grpo_credit(
        self,
        preset: str,
        group_size: int,
        gamma: float | None,
        normalize_adv: bool | None,
        positive_only: bool,
        std_default: bool = False,
    ) -> CreditAssigner:
        """GRPO's credit: the group-centred return (divided by the group std with
        ``normalize_adv``, unset: ``std_default``), or ``reward_norm`` / ``adv_norm``.
        ``normalize_adv`` is the std of the preset's own normalisation, so it and
        ``reward_norm`` are exclusive."""
        if normalize_adv is not None and self.reward_norm is not None:
            raise ValueError(
                f"{preset}: normalize_adv={normalize_adv!r} and reward_norm both set; "
                "normalize_adv is reward_norm's std_level (group or null): give only reward_norm"
            )
        std = std_default if normalize_adv is None else bool(normalize_adv)
        builtin = GroupNormalizedReturn(
            group_size, normalize_adv=std, positive_only=positive_only, gamma=gamma
        )
        return self.group_credit(builtin, positive_only)

    def without_std(self, preset: str) -> None:
        """Refuse a ``reward_norm`` / ``adv_norm`` with a std (Dr. GRPO drops it)."""
        for name, cfg in (("reward_norm", self.reward_norm), ("adv_norm", self.adv_norm)):
            if cfg is not None and NormConfig.parse(cfg, name).std_level is not None:
                raise ValueError(
                    f"{name}.std_level must be null in {preset}: dropping the std is half of "
                    "Dr. GRPO; use grpo for a std normalisation"
                )
