"""``ludic up --resume NAME``: what a run saves at its start, what a resume reads back, and
the clear refusals (no such run, a --config beside it, no checkpoints, a run still going).
The resumed run itself, after a SIGKILL of ``ludic up``, is in
tests/integration/test_up_faults.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.common.settings import load_settings
from services.launcher.main import main, resume_settings
from services.launcher.settings import UpSettings
from services.launcher.worker import PID_FILE, SAVED_CONFIG, Run


def _start(tmp_path: Path, *flags: str, checkpoint_every: int = 2) -> tuple[UpSettings, Path]:
    """Settings of a run started with ``flags``, and its saved config (as Run writes it)."""
    cfg = {
        "up": {"name": "r1", "runs_dir": str(tmp_path / "runs"), "actors": 2},
        "learner": {"num_steps": 6, "checkpoint_every": checkpoint_every},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    s = load_settings(UpSettings, ["--config", str(path), *flags], service="up", environ={})
    Run(s).save_config()
    return s, tmp_path / "runs" / "r1" / SAVED_CONFIG


def test_a_resume_reads_the_saved_config_with_the_flags_the_run_started_with(tmp_path) -> None:
    first, saved = _start(tmp_path, "--actors", "3", "--timeout-s", "77")
    data = yaml.safe_load(saved.read_text())
    assert data["run_id"]  # generated when the config has none: a resume must reuse it
    assert data["learner"] == {"num_steps": 6, "checkpoint_every": 2}
    runs = str(tmp_path / "runs")
    s = resume_settings(UpSettings(resume="r1", runs_dir=runs), ["--resume", "r1"])
    assert isinstance(s, UpSettings), s
    assert (s.actors, s.timeout_s, s.name, s.fresh) == (3, 77.0, "r1", False)
    assert s.config_path == str(saved.resolve())
    # a flag given with --resume wins over the saved setting
    s = resume_settings(UpSettings(resume="r1", runs_dir=runs), ["--actors", "1"])
    assert isinstance(s, UpSettings) and s.actors == 1 and s.timeout_s == 77.0
    # how this invocation runs is not part of the run
    assert not {"config_path", "resume", "fresh", "live", "log_level"} & set(data["up"])


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal that regressed must fail the test, not start a whole stack."""

    def execute(self: Run) -> int:
        raise AssertionError("ludic up --resume started a run it should have refused")

    monkeypatch.setattr(Run, "execute", execute)


def test_resume_refuses_what_it_cannot_continue(tmp_path, capsys, no_run) -> None:
    runs = str(tmp_path / "runs")
    assert main(["--resume", "nope", "--runs-dir", runs]) == 2
    assert "no run 'nope' to resume" in capsys.readouterr().err
    _start(tmp_path)
    assert (
        main(["--resume", "r1", "--runs-dir", runs, "--config", str(tmp_path / "grpo.yaml")]) == 2
    )
    assert "drop --config" in capsys.readouterr().err
    (tmp_path / "runs" / "r1").rename(tmp_path / "runs" / "old")
    _start(tmp_path, checkpoint_every=0)
    assert main(["--resume", "r1", "--runs-dir", runs]) == 2
    assert "kept no learner checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize(
    "launcher",
    [["-m", "services.cli", "up"], ["/opt/venv/bin/ludic", "up"]],
    ids=["python -m services.cli up", "the ludic console script"],
)
def test_resume_refuses_a_run_whose_ludic_up_is_still_going(
    tmp_path, capsys, no_run, launcher
) -> None:
    _start(tmp_path)
    # a process whose command line is a `ludic up`, either way it is started (it only sleeps)
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *launcher])
    try:
        cmdline = Path(f"/proc/{fake.pid}/cmdline")
        deadline = time.monotonic() + 10
        while launcher[-2].encode() not in cmdline.read_bytes():  # until it has exec'd
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (tmp_path / "runs" / "r1" / PID_FILE).write_text(str(fake.pid))
        assert main(["--resume", "r1", "--runs-dir", str(tmp_path / "runs")]) == 2
        assert f"still going (ludic up, pid {fake.pid})" in capsys.readouterr().err
    finally:
        fake.kill()
        fake.wait()
    # a stale pid file (that process is gone) does not block it
    s = resume_settings(UpSettings(resume="r1", runs_dir=str(tmp_path / "runs")), [])
    assert isinstance(s, UpSettings), s
