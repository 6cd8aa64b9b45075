"""The run's experiment trackers: the top-level ``tracker:`` section of the run config, AReaL's
``stats_logger`` trackers under their names, parsed and checked once (:func:`parse_tracker`).
The learner's step logger (metrics.StepLogger) writes every step's stats to each one on::

    tracker:
      wandb: {mode: online, project: p, entity: team, name: null, job_type: null, group: null,
              notes: null, tags: [grpo], id_suffix: train, wandb_base_url: ""}
      tensorboard: {path: runs/tb}                  # learner.tensorboard_dir is its alias
      swanlab: {mode: cloud, project: p, name: null, logdir: null}

AReaL's defaults: every tracker off (``mode: disabled``, ``path: null``). The fallback of
earlier releases stays: with ``tracker.wandb.mode`` unset, ``WANDB_PROJECT`` in the learner's
environment turns W&B on (mode ``WANDB_MODE``, else online) and is the project. A W&B or
SwanLab run's name defaults to the run id (AReaL: its trial name); the W&B run id is
``<run_id>_<id_suffix>``, resumed where it exists (``resume="allow"``), so a learner that
restarts (a crash, ``ludic up --resume``) logs on into the same W&B run; ``id_suffix:
timestamp`` starts a new one each time, ``null`` lets W&B choose. A tracker turned on without
its package installed is an error here, when the settings load (``ludic up`` and ``ludic
check`` load them before anything starts), not a warning in the learner's log.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.settings import read_yaml, redact_values

WANDB_MODES = ("disabled", "online", "offline")
SWANLAB_MODES = ("disabled", "cloud", "local", "offline")

_SECRET = "a config file may be committed, so a secret is never read from it"
_CONFIG = (
    "the tracker's run config is the run config itself (every section, the learner's as it "
    "resolved it), as AReaL's StatsLogger records its whole experiment config"
)
#: AReaL's keys with no meaning here -> why; a run config naming one is refused with the reason
LEFT_OUT: dict[str, dict[str, str]] = {
    "tracker": {
        "experiment_name": "the run id (top-level run_id) names the run and its tracker runs",
        "trial_name": "the run id (top-level run_id) names the run and its tracker runs",
        "fileroot": "tracker files go under learner.output_dir (W&B's in <output_dir>/wandb)",
    },
    "tracker.wandb": {
        "wandb_api_key": f"{_SECRET}: set WANDB_API_KEY in the learner's environment",
        "config": _CONFIG,
    },
    "tracker.swanlab": {
        "api_key": f"{_SECRET}: set SWANLAB_API_KEY in the learner's environment",
        "config": _CONFIG,
    },
}


@dataclass(frozen=True)
class WandBConfig:
    """``tracker.wandb``: AReaL's WandBConfig, less ``wandb_api_key`` and ``config``
    (:data:`LEFT_OUT`)."""

    mode: str = "disabled"
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    job_type: str | None = None
    group: str | None = None
    notes: str | None = None
    tags: tuple[str, ...] | None = None
    id_suffix: str | None = "train"
    wandb_base_url: str = ""

    @property
    def on(self) -> bool:
        return self.mode != "disabled"

    def wandb_id(self, run_id: str) -> str | None:
        """The W&B run id: ``<run_id>_<id_suffix>`` (``timestamp``: the start time), or None
        (``id_suffix: null``: W&B makes a new run at every start)."""
        suffix = self.id_suffix
        if suffix == "timestamp":
            suffix = time.strftime("%Y_%m_%d_%H_%M_%S")
        return f"{run_id}_{suffix}" if suffix else None

    def init_kwargs(
        self, run_id: str, config: Mapping[str, Any], dir_: str | None
    ) -> dict[str, Any]:
        """``wandb.init``'s arguments (``settings``, for ``wandb_base_url``, is the caller's)."""
        wid = self.wandb_id(run_id)
        return {
            "mode": self.mode,
            "project": self.project,
            "entity": self.entity,
            "name": self.name or run_id,
            "job_type": self.job_type,
            "group": self.group,
            "notes": self.notes,
            "tags": list(self.tags) if self.tags is not None else None,
            "config": dict(config),
            "dir": dir_,
            "id": wid,
            "resume": "allow" if wid else None,
        }


@dataclass(frozen=True)
class SwanlabConfig:
    """``tracker.swanlab``: AReaL's SwanlabConfig, less ``api_key`` and ``config``."""

    mode: str = "disabled"
    project: str | None = None
    name: str | None = None
    logdir: str | None = None

    @property
    def on(self) -> bool:
        return self.mode != "disabled"

    def init_kwargs(
        self, run_id: str, config: Mapping[str, Any], output_dir: str
    ) -> dict[str, Any]:
        """``swanlab.init``'s arguments; ``logdir`` defaults to ``<output_dir>/swanlog``."""
        logdir = self.logdir or (str(Path(output_dir) / "swanlog") if output_dir else None)
        return {
            "project": self.project,
            "experiment_name": self.name or run_id,
            "config": dict(config),
            "logdir": logdir,
            "mode": self.mode,
        }


@dataclass(frozen=True)
class TensorBoardConfig:
    """``tracker.tensorboard``: AReaL's TensorBoardConfig (``path``: the event directory)."""

    path: str | None = None


@dataclass(frozen=True)
class TrackerConfig:
    wandb: WandBConfig = field(default_factory=WandBConfig)
    swanlab: SwanlabConfig = field(default_factory=SwanlabConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)


def installed(package: str) -> bool:
    """Whether ``import package`` would find it (a module already imported counts; a
    ``None`` in ``sys.modules`` blocks the import)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def _section(value: Any, where: str, known: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping of {list(known)}, got {value!r}")
    for key in value:
        why = LEFT_OUT.get(where, {}).get(key)
        if why is not None:
            raise ValueError(f"{where}.{key} is not read here: {why}")
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(known)}")
    return dict(value)


def _text(d: Mapping[str, Any], key: str, where: str) -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{where}.{key}={v!r} must be a string (quote it in YAML)")
    return v or None


def _mode(v: Any, where: str, modes: tuple[str, ...]) -> str:
    if v not in modes:
        raise ValueError(f"{where}={v!r}; use one of {list(modes)}")
    return str(v)


def _need(package: str, what: str, fix: str) -> None:
    if not installed(package):
        raise ValueError(
            f"{what}, but the {package} package is not installed where the learner runs: "
            f"pip install {package}, or {fix}"
        )


def _wandb(value: Any, environ: Mapping[str, str]) -> WandBConfig:
    where = "tracker.wandb"
    d = _section(value, where, tuple(f for f in WandBConfig.__dataclass_fields__))
    project = _text(d, "project", where) or environ.get("WANDB_PROJECT") or None
    if d.get("mode") is not None:
        mode = _mode(d["mode"], f"{where}.mode", WANDB_MODES)
        what, fix = f"{where}.mode={mode!r} logs to W&B", f"set {where}.mode: disabled"
    elif environ.get("WANDB_PROJECT"):  # the fallback of earlier releases
        mode = _mode(environ.get("WANDB_MODE") or "online", "WANDB_MODE", WANDB_MODES)
        what = f"WANDB_PROJECT={environ['WANDB_PROJECT']!r} turns W&B on ({where}.mode unset)"
        fix = f"unset WANDB_PROJECT, or set {where}.mode: disabled"
    else:
        mode, what, fix = "disabled", "", ""
    tags = d.get("tags")
    if tags is not None and (
        not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags)
    ):
        raise ValueError(f"{where}.tags={tags!r} must be a list of strings")
    base_url = d.get("wandb_base_url") or ""
    if not isinstance(base_url, str):
        raise ValueError(f"{where}.wandb_base_url={base_url!r} must be a string (a URL)")
    out = WandBConfig(
        mode=mode,
        project=project,
        entity=_text(d, "entity", where),
        name=_text(d, "name", where),
        job_type=_text(d, "job_type", where),
        group=_text(d, "group", where),
        notes=_text(d, "notes", where),
        tags=tuple(tags) if tags is not None else None,
        id_suffix=_text(d, "id_suffix", where) if "id_suffix" in d else "train",
        wandb_base_url=base_url,
    )
    if out.on:
        _need("wandb", what, fix)
    return out


def _swanlab(value: Any) -> SwanlabConfig:
    where = "tracker.swanlab"
    d = _section(value, where, tuple(SwanlabConfig.__dataclass_fields__))
    mode = _mode(d.get("mode") or "disabled", f"{where}.mode", SWANLAB_MODES)
    out = SwanlabConfig(
        mode=mode,
        project=_text(d, "project", where),
        name=_text(d, "name", where),
        logdir=_text(d, "logdir", where),
    )
    if out.on:
        _need("swanlab", f"{where}.mode={mode!r} logs to SwanLab", f"set {where}.mode: disabled")
    return out


def _tensorboard(value: Any, tensorboard_dir: str) -> TensorBoardConfig:
    where = "tracker.tensorboard"
    d = _section(value, where, ("path",))
    path = _text(d, "path", where)
    if path and tensorboard_dir and Path(path) != Path(tensorboard_dir):
        raise ValueError(
            f"learner.tensorboard_dir={tensorboard_dir!r} and {where}.path={path!r} name the "
            "same setting (tensorboard_dir is its alias) with different values: keep one"
        )
    path = path or tensorboard_dir or None
    if path:
        _need(
            "tensorboard",
            f"{where}.path (or learner.tensorboard_dir) {path!r} writes TensorBoard events",
            "drop the path",
        )
    return TensorBoardConfig(path=path)


def parse_tracker(
    section: Any, *, tensorboard_dir: str = "", environ: Mapping[str, str] | None = None
) -> TrackerConfig:
    """The run config's ``tracker:`` section, checked: an unknown key, a bad mode or a value
    of the wrong type is a ``ValueError`` naming the key, and so is a tracker that is on
    without its package. ``tensorboard_dir``: the learner's alias of ``tensorboard.path``;
    ``environ`` (default ``os.environ``): where ``WANDB_PROJECT`` / ``WANDB_MODE`` are read."""
    env = os.environ if environ is None else environ
    d = _section(section, "tracker", ("wandb", "swanlab", "tensorboard"))
    return TrackerConfig(
        wandb=_wandb(d.get("wandb"), env),
        swanlab=_swanlab(d.get("swanlab")),
        tensorboard=_tensorboard(d.get("tensorboard"), tensorboard_dir),
    )


def run_config(config_path: str | None, learner: Mapping[str, Any]) -> dict[str, Any]:
    """What a tracker records as its run's config: the run config file's sections (the
    password of every URL masked), its ``learner:`` section replaced by ``learner``, the
    learner's settings as it resolved them (defaults, environment and flags included;
    the caller masks their secrets: ``services.common.settings.redacted``)."""
    doc = redact_values(read_yaml(config_path)) if config_path else {}
    return {**doc, "learner": dict(learner)}
