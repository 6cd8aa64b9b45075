"""An RL algorithm is a composition: CreditAssigner + Loss (+ optional rollout preprocess).

``RLAlgorithm.to_saw_items(rollouts)`` is the whole rollout -> training-sample path:
``preprocess`` (whole groups, before credit) -> ``credit_assigner.compute`` ->
``rollouts_to_saw_items`` -> ``sample_filter`` (per item, after credit).

Presets (keyword-only) cover the common algorithms; anything else is a new composition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from libludic.training.batching.saw import rollouts_to_saw_items
from libludic.training.credit_assignment import (
    ConstantCredit,
    CreditAssigner,
    GroupNormalizedReturn,
    HybridNormalizedReturn,
    MonteCarloReturn,
)
from libludic.training.filters import (
    PreprocessFn,
    SampleFilter,
    apply_filter,
    drop_zero_variance_groups,
)
from libludic.training.loss import (
    CISPOLoss,
    CompositeLoss,
    LossTerm,
    MaskedCausalLMCrossEntropyLoss,
    ReinforceLoss,
    TokenClippedSurrogateLoss,
    TokenKLLoss,
)
from libludic.training.types import SAWItem
from libludic.types import Rollout


@dataclass
class RLAlgorithm:
    name: str
    credit_assigner: CreditAssigner
    loss: Any  # a libludic.training.loss.Loss
    preprocess: Optional[PreprocessFn] = None

    @property
    def needs_actor_logprobs(self) -> bool:
        return bool(getattr(self.loss, "needs_actor_logprobs", False))

    def to_saw_items(
        self, rollouts: Sequence[Rollout], sample_filter: Optional[SampleFilter] = None
    ) -> List[SAWItem]:
        rs = list(rollouts)
        if self.preprocess is not None:
            rs = self.preprocess(rs)
        if not rs:
            return []
        weights = self.credit_assigner.compute(rs)
        return apply_filter(rollouts_to_saw_items(rs, weights), sample_filter)


def _with_kl(loss: Any, kl_coeff: float, name: str) -> Any:
    if kl_coeff < 0:
        raise ValueError(f"kl_coeff={kl_coeff} must be >= 0")
    if kl_coeff == 0.0:
        return loss
    return CompositeLoss(
        terms=[LossTerm(name, loss, 1.0), LossTerm("kl", TokenKLLoss(), kl_coeff)]
    )


def make_reinforce(*, gamma: float = 1.0, aggregation: str = "token") -> RLAlgorithm:
    """MonteCarloReturn(gamma) + ReinforceLoss."""
    return RLAlgorithm(
        name="reinforce",
        credit_assigner=MonteCarloReturn(gamma=gamma),
        loss=ReinforceLoss(aggregation=aggregation),
    )


def make_grpo(
    *,
    group_size: int = 8,
    normalize_adv: bool = False,
    positive_only: bool = False,
    eps_clip: float = 0.2,
    eps_clip_higher: Optional[float] = None,
    dual_clip_c: Optional[float] = None,
    kl_coeff: float = 0.0,
    aggregation: str = "token",
) -> RLAlgorithm:
    """GroupNormalizedReturn + TokenClippedSurrogateLoss (+ k3 KL when kl_coeff > 0).

    ``normalize_adv`` defaults to False as in GroupNormalizedReturn (mean-centred only);
    set True for the original GRPO's division by the group std.
    """
    loss = TokenClippedSurrogateLoss(
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        dual_clip_c=dual_clip_c,
        aggregation=aggregation,
    )
    return RLAlgorithm(
        name="grpo",
        credit_assigner=GroupNormalizedReturn(
            group_size=group_size, normalize_adv=normalize_adv, positive_only=positive_only
        ),
        loss=_with_kl(loss, kl_coeff, "pg"),
    )


def make_sft(*, aggregation: str = "token") -> RLAlgorithm:
    """ConstantCredit(1.0) + MaskedCausalLMCrossEntropyLoss."""
    return RLAlgorithm(
        name="sft",
        credit_assigner=ConstantCredit(value=1.0),
        loss=MaskedCausalLMCrossEntropyLoss(aggregation=aggregation),
    )


def make_scalerl(
    *,
    group_size: int = 8,
    filter_zvp: bool = True,
    positive_only: bool = False,
    eps_clip_high: float = 0.2,
    aggregation: str = "token",
) -> RLAlgorithm:
    """HybridNormalizedReturn + CISPOLoss; ``filter_zvp`` drops zero-variance groups."""
    return RLAlgorithm(
        name="scalerl",
        credit_assigner=HybridNormalizedReturn(group_size=group_size, positive_only=positive_only),
        loss=CISPOLoss(eps_clip_high=eps_clip_high, aggregation=aggregation),
        preprocess=drop_zero_variance_groups if filter_zvp else None,
    )


def make_cispo(
    *,
    group_size: int = 8,
    kl_coeff: float = 0.0,
    eps_clip_low: Optional[float] = None,
    eps_clip_high: float = 0.2,
    aggregation: str = "token",
) -> RLAlgorithm:
    """GroupNormalizedReturn + CISPOLoss (+ k3 KL when kl_coeff > 0)."""
    loss = CISPOLoss(
        eps_clip_low=eps_clip_low, eps_clip_high=eps_clip_high, aggregation=aggregation
    )
    return RLAlgorithm(
        name="cispo",
        credit_assigner=GroupNormalizedReturn(group_size=group_size),
        loss=_with_kl(loss, kl_coeff, "cispo"),
    )
