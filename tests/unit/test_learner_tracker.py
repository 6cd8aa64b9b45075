"""The run config's ``tracker:`` section (services/learner/tracker.py): W&B, SwanLab and
TensorBoard under AReaL's names, from the YAML to the learner's settings to the step logger.

W&B and SwanLab are fakes put in ``sys.modules`` (neither is installed here; the fakes record
what ``init`` and ``log`` receive); TensorBoard is the real ``torch.utils.tensorboard``, read
back with TensorBoard's own reader.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.settings import load_settings, redacted
from services.launcher.resolved import Resolved
from services.launcher.settings import UpSettings
from services.learner import metrics as M
from services.learner.settings import LearnerSettings
from services.learner.tracker import parse_tracker, run_config

PASSWORD = "pw-3c1f"


class FakeTracker(types.ModuleType):
    """``wandb`` / ``swanlab`` as far as the step logger uses them."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.inits: list[dict[str, Any]] = []
        self.logs: list[tuple[dict[str, float], int]] = []
        self.finished = 0

    def init(self, **kw: Any) -> None:
        self.inits.append(kw)

    def log(self, data: dict[str, float], step: int) -> None:
        self.logs.append((dict(data), step))

    def finish(self) -> None:
        self.finished += 1

    class Settings:
        def __init__(self, **kw: Any) -> None:
            self.kw = kw


@pytest.fixture
def wandb(monkeypatch) -> FakeTracker:
    fake = FakeTracker("wandb")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for var in ("WANDB_PROJECT", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    return fake


@pytest.fixture
def swanlab(monkeypatch) -> FakeTracker:
    fake = FakeTracker("swanlab")
    monkeypatch.setitem(sys.modules, "swanlab", fake)
    return fake


def learner(tmp_path: Path, doc: dict[str, Any], environ: dict[str, str] | None = None):
    """The learner's settings as it loads them from a run config holding ``doc``."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_settings(
        LearnerSettings, ["--config", str(path)], service="learner", environ=environ or {}
    )


WANDB = {
    "mode": "offline",
    "project": "ludic-arith",
    "entity": "team-a",
    "job_type": "train",
    "group": "ablation-kl",
    "notes": "k3 loss term",
    "tags": ["grpo", "arith"],
}


def test_the_wandb_section_reaches_wandb_init_and_each_step_reaches_wandb_log(
    tmp_path, wandb
) -> None:
    doc = {
        "run_id": "arith-7",
        "redis_url": f"redis://:{PASSWORD}@redis:6379/0",
        "algorithm": {"name": "grpo", "group_size": 4},
        "learner": {"device": "cpu", "lr": 3e-4},
        "tracker": {"wandb": WANDB},
    }
    s = learner(tmp_path, doc)
    assert s.trackers.wandb.on and s.trackers.wandb.tags == ("grpo", "arith")
    out = tmp_path / "learner"
    logger = M.StepLogger(
        s.trackers,
        run_id=s.run_id,
        config=run_config(s.config_path, redacted(s)),
        output_dir=str(out),
    )
    (kw,) = wandb.inits
    config = kw.pop("config")
    assert kw == {
        **WANDB,
        "name": "arith-7",  # the run id: the section names no run
        "dir": str(out),
        "id": "arith-7_train",  # <run_id>_<id_suffix>, AReaL's default suffix
        "resume": "allow",  # a restarted learner logs on into the same W&B run
    }
    # the run config's sections, the learner's as it resolved them, no password anywhere
    assert config["algorithm"] == {"name": "grpo", "group_size": 4}
    assert config["tracker"] == {"wandb": WANDB}
    assert config["learner"]["lr"] == 3e-4 and config["learner"]["batch_size"] == 64
    assert PASSWORD not in str(config) and "redis://:***@redis:6379/0" in str(config)
    steps = [({"step": 1.0, "loss": 0.5, "lr": 3e-4}, 2), ({"step": 2.0, "loss": 0.25}, 5)]
    for stats, dropped in steps:
        logger.step(M.logged_stats(stats, {"groups_zero_variance": dropped}))
    logger.close()
    assert wandb.logs == [
        ({"step": 1.0, "loss": 0.5, "lr": 3e-4, "run/dynamic_sampling_dropped_total": 2.0}, 1),
        ({"step": 2.0, "loss": 0.25, "run/dynamic_sampling_dropped_total": 5.0}, 2),
    ]
    assert wandb.finished == 1


def test_the_run_name_the_id_suffix_and_the_base_url(tmp_path, wandb) -> None:
    cfg = parse_tracker(
        {
            "wandb": {
                "mode": "online",
                "name": "kl-0.1",
                "id_suffix": "timestamp",
                "wandb_base_url": "https://wandb.example.org",
            }
        },
        environ={},
    )
    M.StepLogger(cfg, run_id="r1")
    (kw,) = wandb.inits
    assert kw["name"] == "kl-0.1" and kw["dir"] is None  # no output_dir: wandb's own
    assert re.fullmatch(r"r1_\d{4}_\d\d_\d\d_\d\d_\d\d_\d\d", kw["id"])  # a new run per start
    assert kw["settings"].kw == {"base_url": "https://wandb.example.org"}
    # id_suffix null: no id, W&B makes a new run every start
    cfg = parse_tracker({"wandb": {"mode": "online", "id_suffix": None}}, environ={})
    assert cfg.wandb.init_kwargs("r1", {}, None)["id"] is None
    assert cfg.wandb.init_kwargs("r1", {}, None)["resume"] is None


def test_wandb_project_in_the_environment_stays_the_fallback(wandb) -> None:
    """Earlier releases turned W&B on with WANDB_PROJECT alone: with tracker.wandb.mode unset
    it still does (mode WANDB_MODE, else online); the section's own values win."""
    assert not parse_tracker({}, environ={}).wandb.on  # AReaL's default: disabled
    env = {"WANDB_PROJECT": "legacy"}
    w = parse_tracker({}, environ=env).wandb
    assert (w.mode, w.project) == ("online", "legacy")
    w = parse_tracker({}, environ={**env, "WANDB_MODE": "offline"}).wandb
    assert w.mode == "offline"
    w = parse_tracker({"wandb": {"mode": "disabled"}}, environ=env).wandb
    assert not w.on  # said off in the config: off
    w = parse_tracker({"wandb": {"mode": "online", "project": "mine"}}, environ=env).wandb
    assert w.project == "mine"
    with pytest.raises(ValueError, match=r"WANDB_MODE='dryrun'; use one of"):
        parse_tracker({}, environ={**env, "WANDB_MODE": "dryrun"})


def test_swanlab_is_optional_and_gets_its_section(tmp_path, swanlab) -> None:
    cfg = parse_tracker(
        {"swanlab": {"mode": "local", "project": "ludic", "logdir": str(tmp_path / "sw")}},
        environ={},
    )
    logger = M.StepLogger(cfg, run_id="r2", config={"learner": {"lr": 1.0}})
    logger.step({"step": 3.0, "loss": 1.5})
    logger.close()
    assert swanlab.inits == [
        {
            "project": "ludic",
            "experiment_name": "r2",  # the run id, as W&B's name
            "config": {"learner": {"lr": 1.0}},
            "logdir": str(tmp_path / "sw"),
            "mode": "local",
        }
    ]
    assert swanlab.logs == [({"step": 3.0, "loss": 1.5}, 3)] and swanlab.finished == 1
    # no logdir: under the learner's output_dir
    kw = parse_tracker({"swanlab": {"mode": "cloud"}}, environ={}).swanlab.init_kwargs(
        "r2", {}, "/out"
    )
    assert kw["logdir"] == "/out/swanlog"


def test_trackers_off_import_nothing(monkeypatch) -> None:
    """Neither package is needed while its tracker is off (None in sys.modules blocks an
    import: the logger would raise ImportError if it tried)."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "swanlab", None)
    logger = M.StepLogger(parse_tracker({"wandb": {"project": "p"}}, environ={}))
    logger.step({"step": 1.0})
    logger.close()
    assert logger.wandb is None and logger.swanlab is None and logger.tb is None


@pytest.mark.parametrize(
    "section, env, match",
    [
        (
            {"wandb": {"mode": "online"}},
            {},
            r"tracker.wandb.mode='online' logs to W&B, but the wandb package is not installed "
            r"where the learner runs: pip install wandb, or set tracker.wandb.mode: disabled",
        ),
        (
            {},
            {"WANDB_PROJECT": "p"},
            r"WANDB_PROJECT='p' turns W&B on \(tracker.wandb.mode unset\), but the wandb package "
            r".*or unset WANDB_PROJECT",
        ),
        (
            {"swanlab": {"mode": "cloud"}},
            {},
            r"tracker.swanlab.mode='cloud' logs to SwanLab, but the swanlab package is not "
            r"installed .*pip install swanlab",
        ),
        (
            {"tensorboard": {"path": "tb"}},
            {},
            r"tracker.tensorboard.path \(or learner.tensorboard_dir\) 'tb' writes TensorBoard "
            r"events, but the tensorboard package is not installed",
        ),
    ],
)
def test_a_tracker_on_without_its_package_is_refused_at_start_up(
    tmp_path, monkeypatch, section, env, match
) -> None:
    for package in ("wandb", "swanlab", "tensorboard"):
        monkeypatch.setitem(sys.modules, package, None)
    for var in ("WANDB_PROJECT", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        parse_tracker(section)
    # `ludic up` loads the learner's settings before it starts anything: it refuses there
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"up": {"runs_dir": str(tmp_path)}, "tracker": section}))
    up = load_settings(UpSettings, ["--config", str(path)], service="up", environ={})
    with pytest.raises(ValueError, match=match):
        Resolved.of(up)


@pytest.mark.parametrize(
    "section, match",
    [
        ({"wandbb": {}}, r"tracker: unknown key\(s\) \['wandbb'\]; known: \['wandb', 'swanlab'"),
        ({"wandb": {"projet": "p"}}, r"tracker.wandb: unknown key\(s\) \['projet'\]; known: "),
        ({"wandb": {"mode": "on"}}, r"tracker.wandb.mode='on'; use one of \['disabled', 'onl"),
        ({"swanlab": {"mode": "online"}}, r"tracker.swanlab.mode='online'; use one of \['disa"),
        ({"tensorboard": {"dir": "x"}}, r"tracker.tensorboard: unknown key\(s\) \['dir'\]"),
        ({"wandb": {"tags": "grpo"}}, r"tracker.wandb.tags='grpo' must be a list of strings"),
        ({"wandb": {"name": 2024}}, r"tracker.wandb.name=2024 must be a string \(quote it"),
        ({"wandb": "online"}, r"tracker.wandb must be a mapping of \['mode', 'project'"),
        ({"wandb": {"wandb_api_key": "k"}}, r"wandb_api_key is not read here: .*WANDB_API_KEY"),
        ({"swanlab": {"api_key": "k"}}, r"swanlab.api_key is not read here: .*SWANLAB_API_KEY"),
        ({"wandb": {"config": {}}}, r"tracker.wandb.config is not read here: the tracker's run"),
        ({"experiment_name": "e"}, r"tracker.experiment_name is not read here: the run id"),
    ],
)
def test_bad_tracker_sections_are_refused_by_key(wandb, section, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_tracker(section, environ={})


def test_the_section_has_one_place(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"learner.tracker: move it to the top-level tracker:"):
        learner(tmp_path, {"learner": {"tracker": {}}})
    with pytest.raises(ValueError, match=r"AReaL's stats_logger is the top-level tracker:"):
        learner(tmp_path, {"stats_logger": {"wandb": {"mode": "online"}}})


def test_tensorboard_dir_is_the_alias_of_tracker_tensorboard_path(tmp_path) -> None:
    tb = str(tmp_path / "tb")
    alias = learner(tmp_path, {"learner": {"tensorboard_dir": tb}})
    both = learner(
        tmp_path,
        {"learner": {"tensorboard_dir": tb + "/"}, "tracker": {"tensorboard": {"path": tb}}},
    )
    assert alias.trackers.tensorboard.path == tb and both.trackers.tensorboard.path == tb
    with pytest.raises(
        ValueError,
        match=r"learner.tensorboard_dir='a' and tracker.tensorboard.path='b' name the same "
        r"setting \(tensorboard_dir is its alias\) with different values: keep one",
    ):
        learner(
            tmp_path,
            {"learner": {"tensorboard_dir": "a"}, "tracker": {"tensorboard": {"path": "b"}}},
        )


def test_the_yaml_tensorboard_path_gets_every_steps_scalars(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the dev extras)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    s = learner(tmp_path, {"tracker": {"tensorboard": {"path": str(tb)}}})
    logger = M.StepLogger(s.trackers, run_id=s.run_id)
    logger.step({"step": 1.0, "loss": 0.5})
    logger.step({"step": 2.0, "loss": 0.25})
    logger.close()
    ev = EventAccumulator(str(tb))
    ev.Reload()
    assert [(e.step, e.value) for e in ev.Scalars("loss")] == [(1, 0.5), (2, 0.25)]


def test_the_tracker_section_follows_the_one_precedence(tmp_path, wandb) -> None:
    """YAML < LUDIC_TRACKER (JSON) < --tracker, each replacing the section whole."""
    doc = {"tracker": {"wandb": {"mode": "offline", "project": "yaml"}}}
    assert learner(tmp_path, doc).trackers.wandb.project == "yaml"
    env = {"LUDIC_TRACKER": '{"wandb": {"mode": "offline", "project": "env"}}'}
    s = learner(tmp_path, doc, env)
    assert s.trackers.wandb.project == "env"
    path = tmp_path / "run.yaml"
    s = load_settings(
        LearnerSettings,
        ["--config", str(path), "--tracker", '{"wandb": {"mode": "disabled"}}'],
        service="learner",
        environ=env,
    )
    assert not s.trackers.wandb.on
