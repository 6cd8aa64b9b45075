"""Opt-in runtime shape checks at the loss and collate boundaries.

``LUDIC_TYPECHECK=1`` turns them on (read at call time, so tests can flip it); they are off
by default because jaxtyping + beartype cost a few hundred microseconds per call.

Checked contract of a collated batch (see ``libludic.training.collate.collate``)::

    input_ids       int64  [B, T]
    attention_mask  int64  [B, T]
    action_mask     int64  [B, T]
    weight          float  [B]
    actor_logprobs  float  [B, T]
    ref_logprobs    float  [B, T]   (optional)
    logits          float  [B, T, V] (loss boundary only)
"""

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch
from beartype import beartype
from jaxtyping import Float, Int64, jaxtyped

F = TypeVar("F", bound=Callable[..., Any])


def enabled() -> bool:
    return os.environ.get("LUDIC_TYPECHECK", "0").strip().lower() in ("1", "true", "yes")


@jaxtyped(typechecker=beartype)
def _check_batch(
    input_ids: Int64[torch.Tensor, "B T"],  # noqa: F722, F821
    attention_mask: Int64[torch.Tensor, "B T"],  # noqa: F722, F821
    action_mask: Int64[torch.Tensor, "B T"],  # noqa: F722, F821
    weight: Float[torch.Tensor, "B"],  # noqa: F722, F821
    actor_logprobs: Float[torch.Tensor, "B T"],  # noqa: F722, F821
    ref_logprobs: Float[torch.Tensor, "B T"] | None,  # noqa: F722, F821
    logits: Float[torch.Tensor, "B T V"] | None,  # noqa: F722, F821
) -> None:
    return None


def check_batch(batch: Mapping[str, Any], logits: torch.Tensor | None = None) -> None:
    """Raise (jaxtyping's TypeCheckError) if the batch tensors disagree on B/T or dtype."""
    missing = [
        k
        for k in ("input_ids", "attention_mask", "action_mask", "weight", "actor_logprobs")
        if k not in batch
    ]
    if missing:
        raise KeyError(f"batch is missing {missing}; build it with saw.collate()")
    _check_batch(
        batch["input_ids"],
        batch["attention_mask"],
        batch["action_mask"],
        batch["weight"],
        batch["actor_logprobs"],
        batch.get("ref_logprobs"),
        logits,
    )


def checked_loss(fn: F) -> F:
    """Decorator for ``Loss.compute(self, logits, batch)``: shape-check when enabled."""

    @functools.wraps(fn)
    def wrapper(self: Any, logits: torch.Tensor, batch: Mapping[str, Any]) -> Any:
        if enabled():
            check_batch(batch, logits)
        return fn(self, logits, batch)

    return cast(F, wrapper)
