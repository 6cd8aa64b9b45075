"""Rollout generation: requests (what to run) and the engine that runs them against an
inference client with the env / agent / protocol registries. Beside ``envs``, ``agents``
and ``interaction``; the training side (``libludic.training``) consumes what it produces.

Names are re-exported lazily so ``import libludic.rollout`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RolloutEngine": "libludic.rollout.engine",
    "RolloutRequest": "libludic.rollout.request",
    "EnvSpec": "libludic.rollout.request",
    "AgentSpec": "libludic.rollout.request",
    "ProtocolSpec": "libludic.rollout.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'libludic.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
