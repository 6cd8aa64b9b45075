"""The settings of the services ``ludic up`` starts, resolved as those services resolve them.

The launcher decides a few things from other services' knobs: how many steps the live view
counts to (``learner.num_steps``), whether a crashed learner may restart and a run may be
resumed (the learner's checkpoints), whether the learner gets spare cores (its own
``spare_cores``, and synchronous RL: the feeder's ``max_head_offpolicyness`` 0). It reads
them with the service's own settings class through the one loader
(``services.common.settings.load_settings``), given the environment the launcher gives that
service: its own environment plus the run config as ``LUDIC_CONFIG`` and, for the learner,
``LUDIC_OUTPUT_DIR``. So a ``LUDIC_NUM_STEPS`` exported before ``ludic up`` counts for the
launcher exactly as for the learner, over the YAML. The launcher passes no flags to either.

``Resolved.others`` loads the remaining services' settings the same way (``ludic check``).
These imports are the one place a service reads another service's settings class: the
launcher runs every service and must agree with each on its knobs
(tests/unit/test_layering.py allows ``services.<name>.settings`` here and nowhere else).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.actor.settings import ActorSettings
from services.common.settings import load_settings, read_yaml
from services.credit.settings import CreditSettings
from services.eval.settings import EvalSettings
from services.feeder.settings import FeederSettings
from services.launcher.settings import UpSettings
from services.learner.settings import LearnerSettings


def service_environ(
    config_path: str | None, environ: Mapping[str, str] | None = None, **extra: str
) -> dict[str, str]:
    """The ``LUDIC_*`` environment a started service resolves its settings from: the
    launcher's (``environ``, default ``os.environ``; the supervisor passes it on) with the
    run config and ``extra`` over it."""
    env = dict(os.environ if environ is None else environ)
    if config_path:
        env["LUDIC_CONFIG"] = str(config_path)
    env.update(extra)
    return env


@dataclass(frozen=True)
class Resolved:
    """The learner's and the feeder's settings for one run."""

    learner: LearnerSettings
    feeder: FeederSettings

    @classmethod
    def of(cls, s: UpSettings, environ: Mapping[str, str] | None = None) -> Resolved:
        """Raises ValueError (naming the setting) when either service would refuse the run
        config: ``ludic up`` fails before it starts anything."""
        output_dir = str(Path(s.runs_dir) / s.name / "learner")  # Run.start_workers sets it
        learner_env = service_environ(s.config_path, environ, LUDIC_OUTPUT_DIR=output_dir)
        return cls(
            learner=load_settings(LearnerSettings, [], service="learner", environ=learner_env),
            feeder=load_settings(
                FeederSettings,
                [],
                service="feeder",
                environ=service_environ(s.config_path, environ),
            ),
        )

    @staticmethod
    def actor(s: UpSettings, environ: Mapping[str, str] | None = None) -> ActorSettings:
        """The actors' settings (their tasks built with their reward functions): the start-up
        check of item lengths reads their ``max_steps``."""
        env = service_environ(s.config_path, environ)
        return load_settings(ActorSettings, [], service="actor", environ=env)

    @staticmethod
    def others(s: UpSettings, environ: Mapping[str, str] | None = None) -> dict[str, object]:
        """The settings of the services ``of`` does not read, each loaded as it loads its
        own (``ludic check``, beside :meth:`actor`): credit's (the algorithm built) and, when
        the config has an ``eval:`` section, the eval service's (compose and Helm run it;
        ``ludic up`` evaluates by itself)."""
        env = service_environ(s.config_path, environ)
        out: dict[str, object] = {
            "credit": load_settings(CreditSettings, [], service="credit", environ=env),
        }
        if s.config_path and "eval" in read_yaml(s.config_path):
            out["eval"] = load_settings(EvalSettings, [], service="eval", environ=env)
        return out

    @property
    def num_steps(self) -> int | None:
        """The learner's step count (None: until stopped)."""
        return self.learner.num_steps or None

    @property
    def checkpoints(self) -> bool:
        """Whether the learner checkpoints (it then resumes after a crash or a stop)."""
        return self.learner.checkpoint_config() is not None

    @property
    def synchronous(self) -> bool:
        """Admission bound 0: generation waits for each learner step."""
        return self.feeder.max_head_offpolicyness == 0

    @property
    def learner_spare_cores(self) -> tuple[int, ...]:
        """The learner's own ``spare_cores`` (flat or in ``trainer:``), as it resolves them."""
        return tuple(self.learner.trainer_config().spare_cores)
