"""Learning-rate schedules, under AReaL's names: ``lr_scheduler_type`` (``constant``,
``linear``, ``cosine``), ``warmup_steps_proportion`` and ``min_lr_ratio``.

The learning rate of optimizer step ``s`` (0 for the first) over a horizon of ``T`` steps
is ``lr * lr_factor(s)``, with ``W = int(warmup_steps_proportion * T)`` warmup steps and
``r = min_lr_ratio``:

* warmup, ``s < W``: ``(s + 1) / W`` (linear up to 1; the first step is not wasted at 0);
* after it, with ``p = min(1, (s - W) / max(1, T - W))`` the progress of the decay:
  ``constant`` 1; ``linear`` ``r + (1 - r) * (1 - p)``; ``cosine``
  ``r + (1 - r) * (1 + cos(pi * p)) / 2``.

The factor is a function of the step alone: nothing to checkpoint, and a resumed run
continues the same curve. Without a horizon (``T`` None: train until stopped) only
``constant`` applies, with no warmup.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def check_shape(kind: str, warmup_steps_proportion: float, min_lr_ratio: float) -> None:
    """ValueError naming the first bad setting of the schedule's shape (its horizon aside)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type={kind!r}; use one of {list(SCHEDULES)}")
    for name, v in (
        ("warmup_steps_proportion", warmup_steps_proportion),
        ("min_lr_ratio", min_lr_ratio),
    ):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{name}={v!r} must be a number")
    if not 0.0 <= warmup_steps_proportion < 1.0:
        raise ValueError(f"warmup_steps_proportion={warmup_steps_proportion!r} must be in [0, 1)")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio!r} must be in [0, 1]")


def check_schedule(
    kind: str, total_steps: int | None, warmup_steps_proportion: float, min_lr_ratio: float
) -> None:
    """ValueError naming the first bad setting."""
    check_shape(kind, warmup_steps_proportion, min_lr_ratio)
    if total_steps is not None and total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r} must be >= 1 or None (no horizon)")
    if kind != "constant" and total_steps is None:
        raise ValueError(
            f"lr_scheduler_type={kind!r} decays over a horizon: set total_steps (the learner "
            "sets it to its num_steps), or use 'constant'"
        )


def lr_factor(
    step: int,
    kind: str,
    total_steps: int | None,
    warmup_steps_proportion: float,
    min_lr_ratio: float,
) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if total_steps is None:
        return 1.0
    warmup = int(warmup_steps_proportion * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay
