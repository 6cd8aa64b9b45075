"""``ludic up`` acts on the learner's and feeder's knobs as those services resolve them.

The launcher counts to ``num_steps``, restarts (and resumes) a learner that checkpoints, and
gives the learner spare cores in synchronous runs. Each value here is set in the YAML and
overridden by a ``LUDIC_*`` variable of the launcher's environment (which the services
inherit): the launcher's decision follows the override, and the learner, loading its settings
from the exact argv and environment the launcher starts it with, resolves the same value.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from services.common.settings import load_settings
from services.launcher import main as up_main
from services.launcher.cpus import CpuPlan
from services.launcher.settings import UpSettings
from services.launcher.supervisor import ServiceSpec
from services.launcher.worker import Run
from services.learner.settings import LearnerSettings

PLAN = CpuPlan(learner=(1,), others=(0,))


def config(tmp_path: Path, *, head: int = 1, **learner: object) -> UpSettings:
    cfg = {
        "up": {"name": "r1", "runs_dir": str(tmp_path / "runs")},
        "max_head_offpolicyness": head,
        "learner": {"num_steps": 6, "checkpoint_every": 2, "batch_size": 8, **learner},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_settings(UpSettings, ["--config", str(path)], service="up", environ={})


def learner_as_started(run: Run) -> tuple[ServiceSpec, LearnerSettings]:
    """The learner's ServiceSpec from ``run.start_workers`` (nothing started) and the settings
    the learner loads from that spec's argv and environment (the supervisor's: ours + its)."""
    specs: list[ServiceSpec] = []
    run.start = specs.append  # type: ignore[method-assign]
    run.sup.wait_healthy = lambda *a, **k: None  # type: ignore[method-assign]
    run.redis_url, run.inference_url, run.cpu_plan = "redis://127.0.0.1:1/0", "http://x:1", PLAN
    run.start_workers(Path("/model"))
    (spec,) = [s for s in specs if s.name == "learner"]
    argv = spec.argv[spec.argv.index("learner") + 1 :]
    assert argv == []  # no flags: the learner's precedence ends at its environment
    got = load_settings(
        LearnerSettings, argv, service="learner", environ={**os.environ, **spec.env}
    )
    return spec, got


def test_num_steps_yaml_then_environment(tmp_path, monkeypatch) -> None:
    s = config(tmp_path)
    run = Run(s)
    assert run.total_steps == 6 and learner_as_started(run)[1].num_steps == 6
    monkeypatch.setenv("LUDIC_NUM_STEPS", "9")  # env > YAML, for the launcher and the learner
    run = Run(s)
    assert run.total_steps == 9 and learner_as_started(run)[1].num_steps == 9


@pytest.mark.parametrize(
    "yaml_every, env_every, restarts", [(2, None, True), (2, "0", False), (0, "3", True)]
)
def test_checkpoints_decide_the_learner_restart_as_the_learner_sees_them(
    tmp_path, monkeypatch, yaml_every, env_every, restarts
) -> None:
    if env_every is not None:
        monkeypatch.setenv("LUDIC_CHECKPOINT_EVERY", env_every)
    spec, learner = learner_as_started(Run(config(tmp_path, checkpoint_every=yaml_every)))
    assert spec.restart is restarts
    assert (learner.checkpoint_config() is not None) is restarts


def test_resume_follows_the_environment_checkpoint_setting(tmp_path, monkeypatch) -> None:
    s = config(tmp_path, checkpoint_every=0)
    Run(s).save_config()
    monkeypatch.setattr(Run, "execute", lambda self: 0)  # started: nothing more to see
    argv = ["--resume", "r1", "--runs-dir", s.runs_dir]
    assert up_main.main(argv) == 2  # YAML 0: no checkpoints to resume from
    monkeypatch.setenv("LUDIC_CHECKPOINT_EVERY", "2")  # the learner would checkpoint
    assert up_main.main(argv) == 0


@pytest.mark.parametrize(
    "yaml_head, env_head, env_spare, learner_spare",
    [
        (1, None, None, ""),  # asynchronous: the generation core stays generation's
        (1, "0", None, "0"),  # env makes it synchronous: the launcher gives core 0
        (0, None, None, "0"),
        (0, "1", None, ""),  # env makes it asynchronous
        (0, None, "1", "1"),  # the learner's own spare_cores (env) win, the launcher adds none
    ],
)
def test_spare_cores_follow_the_resolved_admission_bound(
    tmp_path, monkeypatch, yaml_head, env_head, env_spare, learner_spare
) -> None:
    if env_head is not None:
        monkeypatch.setenv("LUDIC_MAX_HEAD_OFFPOLICYNESS", env_head)
    if env_spare is not None:
        monkeypatch.setenv("LUDIC_SPARE_CORES", env_spare)
    _, learner = learner_as_started(Run(config(tmp_path, head=yaml_head)))
    assert ",".join(str(c) for c in learner.spare_cores) == learner_spare


def test_a_config_a_service_would_refuse_stops_ludic_up_at_once(tmp_path, capsys) -> None:
    s = config(tmp_path, checkpoint_every=1000)  # 1000 x 8 un-acked items > saw_high_water
    assert s.config_path is not None
    assert up_main.main(["--config", s.config_path, "--runs-dir", s.runs_dir]) == 2
    assert "checkpoint_every=1000 x batch_size=8" in capsys.readouterr().err
