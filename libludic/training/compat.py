"""Spec compatibility: the spellings the library spec uses beside this library's own, kept
in one place so every other module holds one name per idea.

- Learning rate: the spec's table names TrainerConfig's field ``lr``, its example writes
  ``TrainerConfig(learning_rate=...)``. ``lr`` is the stored field; ``learning_rate`` an
  init-only alias (``resolve_learning_rate``), an error when both are given and differ.
  The default ``lr`` is a ``DefaultLR`` so an explicit ``lr`` equal to it still counts as
  given.
- ``runtime_device`` (the spec's "device for serving"): the policy is served by the
  inference service (its own process and device), never by the Trainer, so the field is
  accepted only unset or equal to ``model_device`` (``check_runtime_device``): a different
  device here could only be ignored.
- Loss aggregation: ``"token"`` and ``"sequence"`` name ``"token-mean"`` and
  ``"seq-mean-token-mean"`` (``canonical_aggregation``).
"""

from __future__ import annotations

import torch


class DefaultLR(float):
    """The default ``lr``, typed apart so ``TrainerConfig`` can tell it was not given."""


DEFAULT_LR = DefaultLR(1e-5)


def resolve_learning_rate(lr: float, learning_rate: float | None) -> float:
    """The one learning rate of ``lr`` and the ``learning_rate`` alias."""
    if learning_rate is None:
        return float(lr)
    if type(lr) is not DefaultLR and float(lr) != float(learning_rate):
        raise ValueError(
            f"TrainerConfig got lr={lr!r} and learning_rate={learning_rate!r}; they name "
            "the same setting: pass one of them"
        )
    return float(learning_rate)


def check_runtime_device(runtime_device: str | None, model_device: str) -> None:
    """``runtime_device`` is unset or ``model_device`` (module docstring)."""
    if runtime_device is None:
        return
    try:
        same = torch.device(runtime_device) == torch.device(model_device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"TrainerConfig.runtime_device={runtime_device!r} is not a torch device"
        ) from e
    if not same:
        raise ValueError(
            f"TrainerConfig.runtime_device={runtime_device!r} differs from "
            f"model_device={model_device!r}; the policy is served by the inference service "
            "(choose its device there: the inference process's CUDA_VISIBLE_DEVICES), so "
            "leave runtime_device unset"
        )


AGGREGATION_ALIASES = {"token": "token-mean", "sequence": "seq-mean-token-mean"}


def canonical_aggregation(mode: str) -> str:
    """A loss aggregation under its own name (an alias resolved, anything else as given)."""
    return AGGREGATION_ALIASES.get(mode, mode)
