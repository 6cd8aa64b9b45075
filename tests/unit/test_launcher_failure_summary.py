"""A run `ludic up` stops on an error still leaves `summary.json`: ok false, the error that
stopped it, and what the learner had reported by then."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.settings import load_settings
from services.launcher import worker
from services.launcher.settings import UpSettings
from services.launcher.supervisor import ServiceError
from services.launcher.worker import Run


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: BaseException) -> Run:
    cfg = {"up": {"name": "f1", "runs_dir": str(tmp_path / "runs"), "eval_n": 4}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    s = load_settings(UpSettings, ["--config", str(path)], service="up", environ={})
    run = Run(s)
    monkeypatch.setattr(worker, "prepare_model", lambda s, run_dir: tmp_path / "model")
    for name in ("plan_cpus", "start_redis"):
        monkeypatch.setattr(run, name, lambda: None)

    def start_services(model_dir: Any) -> None:
        # the learner got as far as reporting its exit before the run failed
        final = run.run_dir / "learner" / "learner_final.json"
        final.parent.mkdir(parents=True, exist_ok=True)
        final.write_text(
            json.dumps({"step": 3, "policy_version": 2, "items_trained": 24, "stale_dropped": 1})
        )
        raise fail

    monkeypatch.setattr(run, "start_services", start_services)
    return run


@pytest.mark.parametrize(
    "fail, error",
    [
        (ServiceError("credit exited with code 2:\nTraceback"), "credit exited with code 2"),
        (KeyError("step"), "KeyError: 'step'"),  # a bug of ludic up's own
    ],
)
def test_a_failed_run_writes_its_summary_with_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: BaseException, error: str
) -> None:
    run = _run(tmp_path, monkeypatch, fail)
    assert run.execute() == 1
    s = json.loads((run.run_dir / "summary.json").read_text())
    assert s["ok"] is False and s["error"].startswith(error), s["error"]
    assert (s["steps"], s["samples_trained"], s["stale_dropped"]) == (3, 24, 1)
    assert s["pass_rate_after"] is None


def test_a_summary_that_cannot_be_written_leaves_the_runs_error_and_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run = _run(tmp_path, monkeypatch, ServiceError("inference not healthy"))

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(worker, "write_report", broken)
    assert run.execute() == 1
    assert "inference not healthy" in caplog.text and "disk full" in caplog.text
    assert not (run.run_dir / "summary.json").exists()
