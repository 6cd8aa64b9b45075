"""The run's algorithm, configured once: :class:`AlgorithmSpec`, the ``algorithm:`` section
of the run config (a preset's name, its ``group_size`` and ``kwargs``, and the optimisation
options :data:`TRAINER_OPTIONS`), read by the feeder (group_size), the credit worker and the
learner. The presets themselves are libludic/training/presets.py's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from libludic.training.algorithm import RLAlgorithm
from libludic.training.config import TrainerConfig
from libludic.training.preset_options import preset_arguments
from libludic.training.presets import ALGORITHMS
from libludic.training.schedule import check_shape

#: the optimisation options of the ``algorithm:`` section: TrainerConfig fields under
#: AReaL's names (``actor.ppo_n_minibatches``, ``actor.gradient_checkpointing``,
#: ``actor.optimizer.{lr_scheduler_type, warmup_steps_proportion, min_lr_ratio}``), read by
#: the learner; their defaults are TrainerConfig's
TRAINER_OPTIONS = (
    "lr_scheduler_type",
    "warmup_steps_proportion",
    "min_lr_ratio",
    "ppo_n_minibatches",
    "gradient_checkpointing",
)
_TRAINER_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(TrainerConfig) if f.name in TRAINER_OPTIONS
}
SPEC_KEYS = ("name", "group_size", "kwargs", *TRAINER_OPTIONS)


@dataclass(frozen=True)
class AlgorithmSpec:
    """The run's algorithm, configured once: ``ALGORITHMS[name](group_size=..., **kwargs)``
    and the optimisation options of :data:`TRAINER_OPTIONS`.

    ``group_size`` is also the feeder's episodes per request and the credit worker's group
    size, so it lives here and not in ``kwargs``; presets without a group (reinforce, sft)
    ignore it in the factory. The optimisation options (the learning-rate schedule of
    libludic.training.schedule, PPO minibatches, gradient checkpointing) are the learner's
    TrainerConfig fields of the same names (``trainer_options``); the schedule's horizon is
    the learner's ``num_steps``.
    """

    name: str = "grpo"
    group_size: int = 8
    kwargs: dict[str, Any] = field(default_factory=dict)
    lr_scheduler_type: str = _TRAINER_DEFAULTS["lr_scheduler_type"]
    warmup_steps_proportion: float = _TRAINER_DEFAULTS["warmup_steps_proportion"]
    min_lr_ratio: float = _TRAINER_DEFAULTS["min_lr_ratio"]
    ppo_n_minibatches: int = _TRAINER_DEFAULTS["ppo_n_minibatches"]
    gradient_checkpointing: bool = _TRAINER_DEFAULTS["gradient_checkpointing"]

    def __post_init__(self) -> None:
        self._check_trainer_options()
        if self.name not in ALGORITHMS:
            raise ValueError(f"algorithm.name={self.name!r}; use one of {sorted(ALGORITHMS)}")
        if (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size < 1
        ):
            raise ValueError(f"algorithm.group_size={self.group_size!r} must be an integer >= 1")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"algorithm.kwargs={self.kwargs!r} must be a mapping")
        if "group_size" in self.kwargs:
            raise ValueError(
                f"algorithm.kwargs.group_size={self.kwargs['group_size']!r}: move it to "
                "algorithm.group_size (one value for feeder, credit and learner)"
            )
        params = preset_arguments(ALGORITHMS[self.name])
        misplaced = sorted(set(self.kwargs) & set(TRAINER_OPTIONS))
        if misplaced:
            raise ValueError(
                f"algorithm.kwargs {misplaced} are optimisation options, not preset arguments: "
                f"move them up one level, to algorithm.{misplaced[0]}"
            )
        unknown = sorted(set(self.kwargs) - set(params))
        if unknown:
            known = sorted(p for p in params if p != "group_size")
            raise ValueError(
                f"algorithm.kwargs {unknown} are not arguments of make_{self.name}; known: {known}"
            )
        if self.build().dynamic_sampling and self.group_size == 1:
            raise ValueError(
                f"algorithm {self.name!r} with group_size=1 and dynamic sampling drops every "
                "group (one rollout never has reward variance); set algorithm.group_size >= 2 "
                "or algorithm.kwargs.dynamic_sampling: false"
            )

    def _check_trainer_options(self) -> None:
        try:
            check_shape(self.lr_scheduler_type, self.warmup_steps_proportion, self.min_lr_ratio)
        except ValueError as e:
            raise ValueError(f"algorithm.{e}") from None
        n = self.ppo_n_minibatches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"algorithm.ppo_n_minibatches={n!r} must be an integer >= 1")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(
                f"algorithm.gradient_checkpointing={self.gradient_checkpointing!r} must be "
                "true or false"
            )

    def trainer_options(self) -> dict[str, Any]:
        """The optimisation options as TrainerConfig keyword arguments."""
        return {k: getattr(self, k) for k in TRAINER_OPTIONS}

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> AlgorithmSpec:
        """The ``algorithm:`` section ({name, group_size, kwargs} and the optimisation
        options); None/empty = defaults."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(
                f"algorithm: must be a mapping like {{name: grpo, group_size: 8, kwargs: {{}}}}, "
                f"got {d!r}"
            )
        unknown = sorted(set(d) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in the algorithm: section; known: "
                f"{', '.join(SPEC_KEYS)} (preset arguments such as kl_coeff go under kwargs)"
            )
        kw: dict[str, Any] = dict(d)
        for k in ("group_size", "ppo_n_minibatches"):
            if k in kw and isinstance(kw[k], str) and kw[k].isdigit():
                kw[k] = int(kw[k])
        if kw.get("kwargs") is None:
            kw.pop("kwargs", None)
        return cls(**kw)

    def build(self, group_size: int | None = None) -> RLAlgorithm:
        """The RLAlgorithm; ``group_size`` overrides the configured one (partial groups)."""
        factory = ALGORITHMS[self.name]
        kw = dict(self.kwargs)
        if "group_size" in preset_arguments(factory):
            kw["group_size"] = self.group_size if group_size is None else group_size
        try:
            return factory(**kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"algorithm {self.name!r} with kwargs {self.kwargs}: {e}") from e
