"""Rollouts -> State-Action-Weight items -> padded tensors and micro-batches.

Token-in/token-out: an item's ``input_ids`` are ``trace.prompt_token_ids +
trace.completion_token_ids`` exactly as the inference server saw and sampled them. Text is
never re-tokenised, so the actor's logprobs line up with the trainer's tokens 1:1.

Over-long items (more than ``max_seq_len`` tokens) are **truncated from the left of the
state**: the oldest prompt tokens are dropped, every action token is kept. An item whose
action tokens would be cut (the action alone, plus the one state token that predicts its
first token, does not fit) is **rejected** with a ValueError naming the item.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from libludic.saw import SampleAttachments, SAWItem
from libludic.training import typecheck
from libludic.types import Rollout, RolloutStepKey


def rollouts_to_saw_items(
    rollouts: Sequence[Rollout], weights: Mapping[RolloutStepKey, float]
) -> list[SAWItem]:
    """One SAWItem per step (with a TokenTrace) of every rollout.

    ``weights[(rollout.id, step.index)]`` is the step's credit (a CreditAssigner's output).
    Attachments: ``actor_logprobs`` aligned to input_ids (0.0 on state tokens; None when
    the trace has no logprobs), ``policy_version`` of the step and the trace's sampling
    ``temperature``. ``meta`` carries item_id
    ``"{rollout_id}:{step_index}"``, rollout_id, step_index, group_id, reward (rollout
    total), step_reward, truncated, terminated and, when the step recorded them,
    finish_reason and parse_error.
    """
    items: list[SAWItem] = []
    for r in rollouts:
        total = r.total_reward
        for step in r.steps:
            tr = step.trace
            if tr is None:
                raise ValueError(
                    f"Rollout {r.id} step {step.index} has no TokenTrace; the trainer needs the "
                    "server's token ids. Request them with InferenceSpec(return_spec="
                    "ReturnSpec.for_rl()) (the RolloutRequest default)"
                )
            key = (r.id, step.index)
            if key not in weights:
                raise KeyError(
                    f"no credit weight for rollout {r.id} step {step.index}; pass the "
                    "CreditAssigner's output for the same rollouts"
                )
            n_state, n_act = len(tr.prompt_token_ids), len(tr.completion_token_ids)
            input_ids = list(tr.prompt_token_ids) + list(tr.completion_token_ids)
            lp = None
            if tr.completion_logprobs is not None:
                lp = [0.0] * n_state + [float(x) for x in tr.completion_logprobs]
            meta = {
                "item_id": f"{r.id}:{step.index}",
                "rollout_id": r.id,
                "step_index": step.index,
                "group_id": r.group_id,
                "reward": total,
                "step_reward": float(step.reward),
                "truncated": bool(step.truncated),
                "terminated": bool(step.terminated),
            }
            for k in ("finish_reason", "parse_error"):
                if k in step.info:
                    meta[k] = step.info[k]
            items.append(
                SAWItem(
                    input_ids=input_ids,
                    attention_mask=[1] * len(input_ids),
                    action_mask=[0] * n_state + [1] * n_act,
                    weight=float(weights[key]),
                    meta=meta,
                    attachments=SampleAttachments(
                        actor_logprobs=lp,
                        policy_version=step.policy_version,
                        temperature=tr.temperature,
                    ),
                )
            )
    return items


def untrainable(
    item: SAWItem,
    *,
    max_seq_len: int | None,
    vocab_size: int | None,
) -> str | None:
    """Why no step could train ``item``, whatever the algorithm (None: one could): no
    action token, reference logprobs of the wrong length, a sequence that cannot be cut to
    ``max_seq_len``, token ids outside the vocabulary. ``OptimizerStep.item_problem`` adds the
    algorithm's checks."""
    if not item.num_action_tokens:  # also an empty item: nothing to train, 0/0 losses
        return "the item has no action token"
    ref = item.attachments.ref_logprobs
    if ref is not None and len(ref) != item.num_tokens:
        return f"ref_logprobs has {len(ref)} entries for {item.num_tokens} tokens"
    if max_seq_len is not None:
        try:
            truncation_offset(item, max_seq_len)
        except ValueError as e:
            return str(e)
    if item.num_tokens:
        ids = item.input_ids
        if isinstance(ids, np.ndarray):
            lo, hi = int(ids.min()), int(ids.max())
        else:
            lo, hi = int(min(ids)), int(max(ids))
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            return f"token ids span [{lo}, {hi}], outside the model's vocabulary [0, {vocab_size})"
    return None


def truncation_offset(item: SAWItem, max_seq_len: int) -> int:
    """How many leading (state) tokens to drop so the item fits ``max_seq_len``.

    Raises ValueError when fitting would cut an action token or the state token that
    predicts the first kept action token.
    """
    n = item.num_tokens
    if n <= max_seq_len:
        return 0
    k = n - max_seq_len
    if any(item.action_mask[: k + 1]):
        raise ValueError(
            f"SAWItem {item.item_id!r} has {n} tokens ({item.num_action_tokens} action) and "
            f"cannot fit max_seq_len={max_seq_len} without cutting action tokens; raise "
            "TrainerConfig.max_seq_len or lower SamplingConfig.max_tokens"
        )
    return k


def effective_len(item: SAWItem, max_seq_len: int | None) -> int:
    return item.num_tokens if max_seq_len is None else min(item.num_tokens, max_seq_len)


def collate(
    items: Sequence[SAWItem], pad_token_id: int, max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad items into tensors (CPU; the trainer moves them).

    Returns ``input_ids`` [B, T] int64 (pad = pad_token_id), ``attention_mask`` [B, T],
    ``action_mask`` [B, T] (0 on padding), ``weight`` [B] float32, ``actor_logprobs``
    [B, T] float32 (0.0 on state, padding and items without logprobs), ``temperature``
    [B] float32 (``SampleAttachments.train_temperature``) and, when every item has them,
    ``ref_logprobs`` [B, T]. T = longest item after left truncation.
    """
    if not items:
        raise ValueError("collate() got no items; the batch source returned an empty batch")
    offs = [0 if max_seq_len is None else truncation_offset(it, max_seq_len) for it in items]
    T = max(it.num_tokens - o for it, o in zip(items, offs, strict=True))
    B = len(items)
    # rows are copied into preallocated arrays: a list row or a decoded (numpy) row alike
    ids = np.full((B, T), pad_token_id, dtype=np.int64)
    attn = np.zeros((B, T), dtype=np.int64)
    act = np.zeros((B, T), dtype=np.int64)
    lp = np.zeros((B, T), dtype=np.float32)
    has_ref = all(it.attachments.ref_logprobs is not None for it in items)
    ref = np.zeros((B, T), dtype=np.float32) if has_ref else None
    for i, (it, o) in enumerate(zip(items, offs, strict=True)):
        n = it.num_tokens - o
        ids[i, :n] = it.input_ids[o:]
        attn[i, :n] = it.attention_mask[o:]
        act[i, :n] = it.action_mask[o:]
        a_lp = it.attachments.actor_logprobs
        if a_lp is not None:
            lp[i, :n] = a_lp[o:]
        r_lp = it.attachments.ref_logprobs
        if ref is not None and r_lp is not None:
            ref[i, :n] = r_lp[o:]
    act *= attn  # padding is never an action, even if a caller left action_mask=1 under attention 0
    out = {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "action_mask": torch.from_numpy(act),
        "weight": torch.tensor([float(it.weight) for it in items], dtype=torch.float32),
        "actor_logprobs": torch.from_numpy(lp),
        "temperature": torch.tensor(
            [it.attachments.train_temperature for it in items], dtype=torch.float32
        ),
    }
    if ref is not None:
        out["ref_logprobs"] = torch.from_numpy(ref)
    if typecheck.enabled():
        typecheck.check_batch(out)
    return out


def pack_micro_batches(
    items: Sequence[SAWItem], micro_token_budget: int, max_seq_len: int | None = None
) -> list[list[SAWItem]]:
    """Split items into micro-batches whose padded size ``B * T_max`` <= the budget.

    Items are sorted longest first (stable, so the split is deterministic) and filled
    greedily; padding waste is small because neighbours have similar lengths. An item
    longer than the budget on its own forms a micro-batch alone (it cannot be split).
    Lengths count after left truncation to ``max_seq_len``.
    """
    if micro_token_budget < 1:
        raise ValueError(f"micro_token_budget={micro_token_budget} must be >= 1")
    lens = [effective_len(it, max_seq_len) for it in items]
    order = sorted(range(len(items)), key=lambda i: -lens[i])
    out: list[list[SAWItem]] = []
    cur: list[SAWItem] = []
    cur_max = 0
    for i in order:
        L = lens[i]
        new_max = max(cur_max, L)
        if cur and (len(cur) + 1) * new_max > micro_token_budget:
            out.append(cur)
            cur, new_max = [], L
        cur.append(items[i])
        cur_max = new_max
    if cur:
        out.append(cur)
    return out


def padded_tokens(micro: Sequence[SAWItem], max_seq_len: int | None = None) -> tuple[int, int]:
    """(B, T_max) of a micro-batch: its padded cost is B * T_max tokens."""
    return len(micro), max((effective_len(it, max_seq_len) for it in micro), default=0)
