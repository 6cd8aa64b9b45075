"""State-Action-Weight items: the data the trainer consumes, as credit writes them to the
wire and the learner reads them back.

A ``SAWItem`` is one model call seen by the trainer: ``input_ids = state_ids +
action_ids`` exactly as the inference server tokenised and sampled them, an
``action_mask`` (1 on sampled action tokens), the credit ``weight`` and attachments
(the actor's chosen-token logprobs aligned to ``input_ids`` and the policy_version
that sampled the action). Everything round-trips through plain dicts.

Token arrays are Python lists or 1-D numpy arrays: items decoded from the wire hold
read-only arrays over the received bytes (no per-token Python objects); ``to_dict`` always
gives lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

IntArray: TypeAlias = list[int] | npt.NDArray[np.integer[Any]]
"""Token ids or a 0/1 mask: a list, or a 1-D integer array (decoded items, read-only)."""
FloatArray: TypeAlias = list[float] | npt.NDArray[np.floating[Any]]
"""Per-token logprobs: a list, or a 1-D float array (decoded items, read-only)."""


def as_list(values: IntArray | FloatArray) -> list[Any]:
    """Plain Python numbers (for JSON, msgpack maps and comparisons)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


@dataclass(frozen=True)
class PendingBatchStage:
    """Credit that has had its group stage only: the learner finishes it over the step's
    items (``RLAlgorithm.apply_batch_stage``; ScaleRL's batch std).

    rollout_items   items of the same rollout that credit wrote (each weighs 1 / this in
                    the batch statistic, so a rollout counts once)
    episode_weight  the rollout's first-step group-stage weight, when the item's differs
                    (per-step credit): the batch statistic is over episode values
    """

    rollout_items: int
    episode_weight: float | None = None

    def problem(self) -> str | None:
        """Why these fields are unusable (None: they are fine)."""
        n, e = self.rollout_items, self.episode_weight
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return f"pending_batch_stage.rollout_items={n!r} is not a positive integer"
        if e is not None and (
            isinstance(e, bool) or not isinstance(e, int | float) or not math.isfinite(e)
        ):
            return f"pending_batch_stage.episode_weight={e!r} is not a finite number"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rollout_items": self.rollout_items,
            "episode_weight": self.episode_weight,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PendingBatchStage:
        # an item written before the fingerprint also names its algorithm here: not read
        return cls(d.get("rollout_items"), d.get("episode_weight"))  # type: ignore[arg-type]


@dataclass
class SampleAttachments:
    """Side data of an item: per-token logprobs aligned with ``SAWItem.input_ids`` (0.0 on
    state tokens), the policy version and the sampling temperature of its action tokens.

    ``temperature``: the trainer computes the item's logprobs as ``log_softmax(logits / T)``,
    the distribution the actor sampled from (and whose logprobs the server returned), so an
    on-policy importance ratio is exactly 1. None or 0 (greedy) means T = 1.
    """

    actor_logprobs: FloatArray | None = None
    ref_logprobs: FloatArray | None = None
    policy_version: int | None = None
    temperature: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "actor_logprobs": None if self.actor_logprobs is None else as_list(self.actor_logprobs),
            "ref_logprobs": None if self.ref_logprobs is None else as_list(self.ref_logprobs),
            "policy_version": self.policy_version,
            "temperature": self.temperature,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SampleAttachments:
        a, r, v = d.get("actor_logprobs"), d.get("ref_logprobs"), d.get("policy_version")
        t = d.get("temperature")
        return cls(
            actor_logprobs=None if a is None else [float(x) for x in a],
            ref_logprobs=None if r is None else [float(x) for x in r],
            policy_version=None if v is None else int(v),
            temperature=None if t is None else float(t),
        )

    @property
    def train_temperature(self) -> float:
        """The temperature the trainer divides this item's logits by (1.0 for None/0)."""
        t = self.temperature
        return 1.0 if t is None or t <= 0.0 else float(t)


@dataclass
class SAWItem:
    """State-Action-Weight: one training sample.

    input_ids      [T]  state_ids + action_ids (server's ids, never re-tokenised)
    attention_mask [T]  1 on real tokens
    action_mask    [T]  0 on state, 1 on action tokens
    weight              credit from the algorithm's CreditAssigner
    meta                item_id, rollout_id, step_index, group_id, reward, ...
    """

    input_ids: IntArray
    attention_mask: IntArray
    action_mask: IntArray
    weight: float
    meta: dict[str, Any] = field(default_factory=dict)
    attachments: SampleAttachments = field(default_factory=SampleAttachments)
    # credit's group stage only: the learner applies the batch stage (None: fully credited)
    pending: PendingBatchStage | None = None
    # the fingerprint of the algorithm whose credit the weight is (libludic.fingerprint;
    # None: not stamped, e.g. an item a user wrote by hand)
    credited_by: str | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.attention_mask) != n or len(self.action_mask) != n:
            raise ValueError(
                f"SAWItem {self.meta.get('item_id')!r}: input_ids ({n}), attention_mask "
                f"({len(self.attention_mask)}) and action_mask ({len(self.action_mask)}) "
                "must have the same length"
            )
        lp = self.attachments.actor_logprobs
        if lp is not None and len(lp) != n:
            raise ValueError(
                f"SAWItem {self.meta.get('item_id')!r}: actor_logprobs has {len(lp)} entries "
                f"for {n} tokens; align it to input_ids with 0.0 on state tokens"
            )

    @property
    def item_id(self) -> str:
        return str(self.meta.get("item_id", ""))

    @property
    def policy_version(self) -> int | None:
        return self.attachments.policy_version

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_action_tokens(self) -> int:
        m = self.action_mask
        return int(m.sum()) if isinstance(m, np.ndarray) else int(sum(m))

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_ids": as_list(self.input_ids),
            "attention_mask": as_list(self.attention_mask),
            "action_mask": as_list(self.action_mask),
            "weight": float(self.weight),
            "meta": dict(self.meta),
            "attachments": self.attachments.to_dict(),
            "pending_batch_stage": None if self.pending is None else self.pending.to_dict(),
            "credited_by": self.credited_by,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SAWItem:
        return cls(
            input_ids=[int(t) for t in d["input_ids"]],
            attention_mask=[int(t) for t in d["attention_mask"]],
            action_mask=[int(t) for t in d["action_mask"]],
            weight=float(d["weight"]),
            meta=dict(d.get("meta") or {}),
            attachments=SampleAttachments.from_dict(d.get("attachments") or {}),
            pending=None
            if not d.get("pending_batch_stage")
            else PendingBatchStage.from_dict(d["pending_batch_stage"]),
            credited_by=d.get("credited_by"),
        )


@dataclass
class SAWBatch:
    """A macro-batch: the items of one optimizer step plus batch-level stats."""

    items: list[SAWItem]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)
