"""The deferred pass-rate curve: each point carries the learner's RL wall at its step (the
clock of samples/s), beside the wall-clock time since the RL phase began."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from services.common.heldout import flatten
from services.common.settings import load_settings
from services.launcher import worker
from services.launcher.settings import UpSettings
from services.launcher.worker import Run


def test_a_deferred_curve_point_holds_the_learners_rl_wall(tmp_path: Path, monkeypatch) -> None:
    cfg = {"up": {"name": "c1", "runs_dir": str(tmp_path / "runs"), "eval_n": 4}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    s = load_settings(UpSettings, ["--config", str(path)], service="up", environ={})
    run = Run(s)
    snaps = run.run_dir / "learner" / "snapshots"
    snaps.mkdir(parents=True)
    # step 10 was trained 12.5 s of wall clock after the RL phase began, 7.25 s of it inside
    # train steps (the rest: start-up, waiting between steps outside the RL wall)
    run.rl_t0_wall = 1000.0
    line = {"step": 10, "time": 1012.5, "rl_wall_s": 7.25, "path": "step_000010.safetensors"}
    (snaps / "snapshots.jsonl").write_text(json.dumps({**line, "policy_version": 10}) + "\n")
    seen: list[Any] = []

    def fake_eval(model_dir: Any, snapshot: Path, sets: Any, version: int) -> dict[str, float]:
        seen.append((snapshot.name, [x.name for x in sets], version))
        return flatten({"heldout": {"pass_rate": 0.5}})

    monkeypatch.setattr(worker, "evaluate_snapshot", fake_eval)
    run.eval_snapshots(tmp_path / "model")
    # every eval set (here the one eval_n makes), at the snapshot's policy version
    assert seen == [("step_000010.safetensors", ["heldout"], 10)]
    (point,) = run.evals
    assert point["step"] == 10.0
    assert point["wall_s"] == 12.5
    assert point["rl_wall_s"] == 7.25
    assert point["eval/pass_rate"] == point["eval/heldout/pass_rate"] == 0.5
