"""The eval service's exports after one evaluation of two sets (inference and Redis faked):
the unlabelled gauges are the first set's, every set's figures are ``ludic_eval_set_*``
gauges labelled by set and role (and reason), the JSON line and the TensorBoard scalars
carry the same figures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from services.common.heldout import flatten
from services.common.settings import load_settings
from services.eval import worker
from services.eval.settings import EvalSettings
from services.eval.worker import EvalService

SETS = [
    {"name": "add", "env": {"kind": "arithmetic", "kwargs": {"split": "eval"}}, "n": 4},
    {
        "name": "ttt2",
        "env": {"kind": "tic_tac_toe_2p"},
        "protocol": {"kind": "multi_agent", "kwargs": {"roles": ["X", "O"]}},
        "n": 2,
        "max_steps": 10,
        "k": 2,
    },
]
RESULTS = {
    "add": {
        "pass_rate": 0.25,
        "reward_mean": 0.5,
        "episode_len_mean": 1.0,
        "truncated_rate_max_steps": 0.0,
        "num_episodes": 4.0,
        "policy_version": 7.0,
        "seconds": 1.5,
    },
    "ttt2": {
        "pass_rate": 0.375,
        "pass_rate/X": 0.5,
        "pass_rate/O": 0.25,
        "illegal_rate/O": 0.125,
        "truncated_rate_max_steps/X": 0.0625,
        "pass_at_k": 0.75,
        "mean_at_k/X": 0.625,
        "parse_error_rate": 0.03125,
        "policy_version": 7.0,
        "seconds": 2.5,
    },
}


def gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_one_evaluation_sets_every_gauge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"up": {"eval_sets": SETS}}))
    out, tb = tmp_path / "evals.jsonl", tmp_path / "tb"
    s = load_settings(
        EvalSettings,
        ["--config", str(cfg), "--output-file", str(out), "--tensorboard-dir", str(tb)],
        service="eval",
        environ={},
    )
    seen: list[Any] = []

    async def fake_sets(url: str, sets: Any, api_key: Any = None) -> dict[str, float]:
        seen.append([x.name for x in sets])
        return flatten(RESULTS)

    async def version(r: Any, keys: Any) -> int:
        return 7

    async def served(self: Any) -> int:
        return 7

    monkeypatch.setattr(worker.heldout, "evaluate_sets", fake_sets)
    monkeypatch.setattr(worker.transport, "get_policy_version", version)
    monkeypatch.setattr(EvalService, "_served_version", served)
    runs = gauge("ludic_eval_runs_total") or 0.0
    svc = EvalService(s, r=None, stop=asyncio.Event())
    res = await svc.evaluate(12)
    assert seen == [["add", "ttt2"]] and res is not None

    # the unlabelled gauges: the first set's figures, as a one-set run always had them
    assert gauge("ludic_eval_pass_rate") == 0.25
    assert gauge("ludic_eval_reward_mean") == 0.5
    assert (gauge("ludic_eval_step"), gauge("ludic_eval_policy_version")) == (12.0, 7.0)
    assert gauge("ludic_eval_runs_total") == runs + 1
    # every set's, by set and role ("all" without one)
    assert gauge("ludic_eval_set_pass_rate", set="add", role="all") == 0.25
    assert gauge("ludic_eval_set_pass_rate", set="ttt2", role="all") == 0.375
    assert gauge("ludic_eval_set_pass_rate", set="ttt2", role="X") == 0.5
    assert gauge("ludic_eval_set_pass_rate", set="ttt2", role="O") == 0.25
    assert gauge("ludic_eval_set_illegal_rate", set="ttt2", role="O") == 0.125
    assert gauge("ludic_eval_set_pass_at_k", set="ttt2", role="all") == 0.75
    assert gauge("ludic_eval_set_mean_at_k", set="ttt2", role="X") == 0.625
    assert gauge("ludic_eval_set_parse_error_rate", set="ttt2", role="all") == 0.03125
    assert gauge("ludic_eval_set_episode_len_mean", set="add", role="all") == 1.0
    assert gauge("ludic_eval_set_episodes", set="add", role="all") == 4.0
    assert (
        gauge("ludic_eval_set_truncated_rate", set="ttt2", role="X", reason="max_steps") == 0.0625
    )
    assert gauge("ludic_eval_set_duration_seconds", set="ttt2") == 2.5
    assert gauge("ludic_eval_set_pass_at_k", set="add", role="all") is None  # k = 0 there

    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["step"] == 12 and line["eval/pass_rate"] == 0.25
    assert line["eval/ttt2/pass_rate/X"] == 0.5

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    [(step, value)] = [(e.step, e.value) for e in acc.Scalars("eval/ttt2/pass_rate/O")]
    assert (step, value) == (12, 0.25)
