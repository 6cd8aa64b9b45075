"""Training side: credit assignment, losses, algorithms, batch sources, Trainer.

Names are re-exported lazily (``from libludic.training import Trainer, make_grpo``) so
that importing one light module of the package (``filters``, ``credit_assignment``, as the
credit service does) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Trainer": "libludic.training.trainer",
    "TrainerConfig": "libludic.training.config",
    "CheckpointConfig": "libludic.training.checkpoint",
    "CheckpointManager": "libludic.training.checkpoint",
    "RLAlgorithm": "libludic.training.algorithm",
    "make_reinforce": "libludic.training.presets",
    "make_grpo": "libludic.training.presets",
    "make_sft": "libludic.training.presets",
    "make_scalerl": "libludic.training.presets",
    "make_cispo": "libludic.training.presets",
    "make_gspo": "libludic.training.presets",
    "make_dr_grpo": "libludic.training.presets",
    "make_ppo": "libludic.training.presets",
    "RolloutEngine": "libludic.rollout.engine",  # where the spec's example imports it from
    "RolloutBatchSource": "libludic.training.batching.rollout_batch_source",
    "OfflineBatchSource": "libludic.training.batching.offline",
    "PipelineBatchSource": "libludic.training.batching.pipeline",
    "SAWItem": "libludic.saw",
    "SAWBatch": "libludic.saw",
    "BatchSource": "libludic.training.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'libludic.training' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
