"""An RL algorithm is a composition: CreditAssigner + Loss (+ optional rollout preprocess).

``RLAlgorithm.to_saw_items(rollouts)`` is the whole rollout -> training-sample path:
``reward_shaping`` (every step reward) -> ``preprocess`` (whole groups, before credit) ->
``credit_assigner.compute`` -> ``rollouts_to_saw_items`` -> ``sample_filter`` (per item,
after credit) -> the batch-level stage, if any -> the no-EOS mask.

The presets that compose one (``make_grpo`` and the others), their reward options and
the run's ``AlgorithmSpec``: libludic.training.presets.

Batch-level stage. A credit assigner whose statistics span the whole training batch
(``HybridNormalizedReturn``: the std of ScaleRL; ``NormalizedReturn`` with a batch-level
``reward_norm`` / ``adv_norm``) has ``group_stage``/``batch_stage``. ``to_saw_items`` runs
the group stage, makes and filters the items, stamps each with ``item.pending``
(libludic.saw.PendingBatchStage: its rollout's items that survived the filters) and runs ``apply_batch_stage`` over the items of the call. The services' credit
worker sees one group at a time, so it calls ``to_saw_items(..., defer_batch_stage=True)``:
items carry the group-stage weight and the stamp, and the Trainer calls
``apply_batch_stage`` on exactly the items of each optimizer step. Both paths take the
batch statistics over the same population, one value per rollout: an item weighs
1 / ``pending.rollout_items``. With per-step returns (the assigners' ``gamma``) a rollout's
items carry different group-stage weights, while the batch statistics are taken over its
episode value, the group-stage weight of its first step: an item whose weight differs from
it carries it as ``pending.episode_weight`` (its first step may be filtered out, or in
another batch), and ``apply_batch_stage`` passes those values as the assigner's
``batch_stage(..., episodes=...)``.

Learner-side advantages (PPO, ``gae``). Values come from a critic trained at train time, so
credit cannot finish them: the credit assigner writes each step's reward as the item's
weight (``StepReward``), and the Trainer's critic turns the step's items into per-token
advantages and value targets (``GAE``, libludic/training/gae.py) before the update; the
loss reads the critic's values (``LossInputs.values``). Both paths, in one process and
across the credit worker and the learner, meet in the learner the same way.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from libludic.fingerprint import fingerprint
from libludic.saw import PendingBatchStage, SAWItem
from libludic.training.collate import rollouts_to_saw_items
from libludic.training.credit_assignment import CreditAssigner, StagedCreditAssigner, staged
from libludic.training.filters import (
    PreprocessFn,
    SampleFilter,
    apply_filter,
    drop_zero_variance_groups,
)
from libludic.training.gae import GAE
from libludic.training.loss import Loss, LossInputs, loss_inputs
from libludic.training.normalization import SumFn
from libludic.training.rewards import RewardShaping
from libludic.types import Rollout


@dataclass
class CreditStats:
    """What ``RLAlgorithm.to_saw_items`` left out, summed over the calls it is passed to."""

    groups_zero_variance: int = 0  # whole groups dropped by dynamic sampling
    items_masked_no_eos: int = 0  # items given weight 0 by mask_no_eos_with_zero


def ended_without_eos(item: SAWItem) -> bool:
    """The item's completion stopped at the token budget (``finish_reason == "length"``)."""
    return item.meta.get("finish_reason") == "length"


@dataclass
class RLAlgorithm:
    """``reward_shaping`` (None: rewards as they are) runs first, on every step reward;
    ``mask_no_eos_with_zero`` gives weight 0 to the items whose completion ended without
    EOS, after the whole credit (their rollouts still count in the group and batch
    statistics; the loss's token counts keep them, as AReaL's mask does).

    ``gae`` (None: the weights are the advantages): the Trainer trains a critic beside the
    policy and computes per-token advantages with it (module docstring); the items' weights
    are then step rewards, and the loss must read the critic's values (a
    ``ClippedValueLoss`` term: make_ppo), as a loss that reads them needs ``gae``."""

    name: str
    credit_assigner: CreditAssigner
    loss: Loss
    preprocess: PreprocessFn | None = None
    reward_shaping: RewardShaping | None = None
    mask_no_eos_with_zero: bool = False
    gae: GAE | None = None

    def __post_init__(self) -> None:
        if self.gae is None and not _reads_values(self.loss):
            return
        if self.gae is None:
            raise ValueError(
                f"algorithm {self.name!r}: its loss reads a critic's values "
                "(ClippedValueLoss) but the algorithm has no gae; use make_ppo, or give "
                "RLAlgorithm(gae=GAE(gamma, gae_lambda)) so the Trainer trains a critic"
            )
        if not isinstance(self.gae, GAE):
            raise ValueError(f"algorithm {self.name!r}: gae={self.gae!r} is not a GAE")
        if not _reads_values(self.loss):
            raise ValueError(
                f"algorithm {self.name!r} has gae but its loss reads no critic values: the "
                "critic would never be trained; add a ClippedValueLoss term (make_ppo)"
            )
        if staged(self.credit_assigner) is not None or self.mask_no_eos_with_zero:
            raise ValueError(
                f"algorithm {self.name!r}: with gae the items' weights are step rewards, so "
                "a batch-level credit stage or mask_no_eos_with_zero (which zeroes a weight) "
                "would change rewards, not advantages; use StepReward credit without them"
            )

    @property
    def needs_critic(self) -> bool:
        """The Trainer trains a critic and computes the advantages with it (``gae``)."""
        return self.gae is not None

    @property
    def inputs(self) -> LossInputs:
        """What the loss reads beyond the logits and the batch (``loss.requires``)."""
        return loss_inputs(self.loss)

    @property
    def needs_actor_logprobs(self) -> bool:
        return self.inputs.actor_logprobs

    @property
    def needs_ref_logprobs(self) -> bool:
        """The loss reads ``batch["ref_logprobs"]`` (a KL term): the Trainer then computes
        them with a frozen copy of the initial policy for items that do not carry them."""
        return self.inputs.ref_logprobs

    @property
    def needs_prox_logprobs(self) -> bool:
        """The loss reads ``batch["prox_logprobs"]`` (``recompute_logprob`` or
        ``use_decoupled_loss``): the Trainer computes them with a no-grad forward of the
        current weights per micro-batch, before the update."""
        return self.inputs.prox_logprobs

    def prox_logprobs_needed(self, n_minibatches: int) -> bool:
        """The Trainer computes ``batch["prox_logprobs"]``: the loss reads them
        (``needs_prox_logprobs``), or its pi_old is the trainer's own logprob (TIS/MIS:
        ``pi_old_is_trained``) and a step takes ``n_minibatches`` > 1 optimizer steps,
        where pi_old must be the policy the step starts from, not the one the previous
        minibatch left (else the ratio is 1 at every minibatch)."""
        inputs = self.inputs
        return inputs.prox_logprobs or (n_minibatches > 1 and inputs.pi_old_is_trained)

    @property
    def fingerprint(self) -> str:
        """What decides an item's weight, as ``"<name>:<hash>"`` (libludic.fingerprint): the
        credit assigner, the reward shaping, the group preprocess and the no-EOS mask. Every
        item ``to_saw_items`` makes carries it (``SAWItem.credited_by``); ``item_problem``
        refuses an item stamped with another."""
        parts = {
            "credit_assigner": self.credit_assigner,
            "reward_shaping": self.reward_shaping,
            "preprocess": self.preprocess,
            "mask_no_eos_with_zero": self.mask_no_eos_with_zero,
        }
        return fingerprint(self.name, parts)

    @property
    def staged_credit(self) -> StagedCreditAssigner | None:
        """The credit assigner when it has statistics over the whole training batch."""
        return staged(self.credit_assigner)

    @property
    def has_batch_stage(self) -> bool:
        return self.staged_credit is not None

    @property
    def dynamic_sampling(self) -> bool:
        """Zero-variance groups are dropped before credit (``drop_zero_variance_groups``)."""
        return self.preprocess is drop_zero_variance_groups

    def to_saw_items(
        self,
        rollouts: Sequence[Rollout],
        sample_filter: SampleFilter | None = None,
        *,
        defer_batch_stage: bool = False,
        stats: CreditStats | None = None,
    ) -> list[SAWItem]:
        """reward shaping -> preprocess -> credit -> SAWItems -> filter -> no-EOS mask.

        ``defer_batch_stage=True`` (the credit worker, which sees one group per call): a
        batch-level stage is left to ``apply_batch_stage`` on the training batch; the items
        carry the group-stage weight and ``item.pending`` (and the
        no-EOS mask waits for that stage too). ``stats`` (optional) is incremented with what
        dynamic sampling dropped and what the mask zeroed. Items keep the task's rewards in
        ``meta["reward"]`` / ``meta["step_reward"]``; with shaping, the shaped rollout total
        is ``meta["shaped_reward"]``.
        """
        raw = list(rollouts)
        rs = raw if self.reward_shaping is None else self.reward_shaping.apply(raw)
        if self.preprocess is not None:
            before = {r.group_id for r in rs if r.group_id is not None}
            rs = self.preprocess(rs)
            if stats is not None and self.dynamic_sampling:
                stats.groups_zero_variance += len(before - {r.group_id for r in rs})
        if not rs:
            return []
        two_stage = self.staged_credit
        if two_stage is not None:
            weights = two_stage.group_stage(rs)
            episode = {str(r.id): float(weights[(r.id, r.steps[0].index)]) for r in rs if r.steps}
            items = apply_filter(rollouts_to_saw_items(rs, weights), sample_filter)
            per_rollout = Counter(str(it.meta["rollout_id"]) for it in items)
            for it in items:
                rid = str(it.meta["rollout_id"])
                # per-step credit (the weight differs): the batch stage needs both
                ep = episode[rid] if it.weight != episode[rid] else None
                it.pending = PendingBatchStage(per_rollout[rid], ep)
        else:
            items = rollouts_to_saw_items(rs, self.credit_assigner.compute(rs))
            items = apply_filter(items, sample_filter)
        if self.reward_shaping is not None:
            _keep_task_rewards(items, raw)
        if self.mask_no_eos_with_zero and stats is not None:
            stats.items_masked_no_eos += sum(1 for it in items if ended_without_eos(it))
        stamp = self.fingerprint
        for it in items:
            it.credited_by = stamp
        if self.has_batch_stage:
            return items if defer_batch_stage else self.apply_batch_stage(items)
        if self.mask_no_eos_with_zero:
            for it in items:
                if ended_without_eos(it):
                    it.weight = 0.0
        return items

    def item_problem(self, item: SAWItem) -> str | None:
        """Why this algorithm cannot train ``item`` (None: it can): what it reads in a step
        (``meta["reward"]``, the batch-stage stamp), checked when an item is read so a
        malformed one is dead-lettered instead of failing the step of every batch-mate."""
        meta = item.meta
        reward = meta.get("reward")
        if reward is not None and (
            isinstance(reward, bool) or not isinstance(reward, (int, float))
        ):
            return f"meta.reward={reward!r} is not a number"
        stamp, p = item.credited_by, item.pending
        if stamp is not None and stamp != self.fingerprint:
            return (
                f"credited_by={stamp!r}: credited by another algorithm than this learner's "
                f"{self.fingerprint!r} (name, credit assigner, reward shaping, preprocess, "
                "no-EOS mask); configure the algorithm once, in the top-level algorithm: "
                "section read by credit and learner, and restart both when it changes"
            )
        if p is None:
            return None
        if not self.has_batch_stage:
            return (
                f"pending_batch_stage: credit left the batch-level stage to the learner, and "
                f"this learner's {self.name!r} has none"
            )
        return p.problem()

    def apply_batch_stage(
        self, items: Sequence[SAWItem], all_sum: SumFn | None = None
    ) -> list[SAWItem]:
        """Items whose weight still lacks the batch-level stage get it, computed over
        exactly ``items`` (plus the other ranks' shards through ``all_sum``), one value per
        rollout (``_rollout_shares``; the value is the item's ``pending.episode_weight``, else
        its weight); other items are returned as they are. A batch must not mix the two.
        The no-EOS mask, when on, applies here."""
        pending = [it for it in items if it.pending is not None]
        if not pending:
            return list(items)
        if len(pending) != len(items):
            raise ValueError(
                f"{len(pending)} of {len(items)} items of the batch still need the batch-level "
                "credit stage (item.pending) and the others do not; feed the "
                "Trainer either the credit worker's items or fully credited ones, not both"
            )
        stamps = sorted({str(it.credited_by) for it in items if it.credited_by is not None})
        two_stage = self.staged_credit
        if two_stage is None or stamps not in ([], [self.fingerprint]):
            raise ValueError(
                f"items were credited by {stamps} (batch-level stage pending) but the trainer "
                f"runs {self.fingerprint!r}; configure the algorithm once, in the top-level "
                "algorithm: section read by credit and learner"
            )
        stage = two_stage.batch_stage
        values, shares = [it.weight for it in items], _rollout_shares(items)
        eps = [None if it.pending is None else it.pending.episode_weight for it in items]
        if any(e is not None for e in eps):  # per-step credit
            episodes = [float(it.weight if e is None else e) for it, e in zip(items, eps)]
            weights = stage(values, all_sum, shares, episodes=episodes)
        else:
            weights = stage(values, all_sum, shares)
        out = []
        for it, w in zip(items, weights, strict=True):
            meta = {**it.meta, "group_weight": it.weight}
            if self.mask_no_eos_with_zero and ended_without_eos(it):
                w = 0.0
            out.append(dataclasses.replace(it, weight=float(w), meta=meta, pending=None))
        return out


def _reads_values(loss: Loss) -> bool:
    """``loss`` declares that it reads a critic's values. A loss whose inputs cannot be read
    (the former flags) is left to the Trainer, which refuses it with the new spelling."""
    try:
        return loss_inputs(loss).values
    except TypeError:
        return False


def _rollout_shares(items: Sequence[SAWItem]) -> list[float]:
    """Each item's weight in a batch statistic: 1 / (items of its rollout after the
    filters, ``pending.rollout_items`` stamped by credit), so a rollout counts once however
    many steps it has (a fraction when its items straddle two training batches). Items
    without the stamp are counted among ``items``."""
    here = Counter(str(it.meta.get("rollout_id")) for it in items)
    return [
        1.0
        / (
            it.pending.rollout_items
            if it.pending is not None
            else here[str(it.meta.get("rollout_id"))]
        )
        for it in items
    ]


def _keep_task_rewards(items: Sequence[SAWItem], raw: Sequence[Rollout]) -> None:
    """``meta["reward"]`` / ``["step_reward"]`` back to the unshaped rewards (what the
    learner reports as ``reward_mean``), the shaped rollout total as ``["shaped_reward"]``."""
    totals = {r.id: r.total_reward for r in raw}
    steps = {(r.id, s.index): float(s.reward) for r in raw for s in r.steps}
    for it in items:
        rid = str(it.meta["rollout_id"])
        it.meta["shaped_reward"] = it.meta["reward"]
        it.meta["reward"] = totals[rid]
        it.meta["step_reward"] = steps[(rid, it.meta["step_index"])]
