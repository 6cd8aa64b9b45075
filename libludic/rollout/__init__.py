"""Rollout generation: the engine that runs requests (``libludic.requests``) against an
inference client with the env / agent / protocol registries. Beside ``envs``, ``agents``
and ``interaction``; the training side (``libludic.training``) consumes what it produces.
"""

from libludic.rollout.engine import RolloutEngine

__all__ = ["RolloutEngine"]
