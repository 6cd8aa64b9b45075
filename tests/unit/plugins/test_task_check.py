"""Fail fast: a task of a run config is built once at start-up (libludic/tasks.py
``check_task``), and ``ludic check`` / ``ludic up`` refuse a bad config in seconds with one
message naming the config key, the value and the choices."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from libludic.plugins import PluginError
from libludic.tasks import TaskSet, TaskSpec, check_task, parse_tasks
from services.launcher.deadletters import NO_TASK, TaskFailureWatch

ROOT = Path(__file__).resolve().parents[3]
OK = {"name": "count", "env": {"kind": "tests.user_plugins:CountDownEnv", "kwargs": {"start": 2}}}


def task(**over: Any) -> TaskSpec:
    return TaskSpec.from_dict({**OK, **over}, "feeder.tasks[0]")


def test_a_users_task_builds_every_part_it_names():
    t = task(
        protocol={"kind": "tests.user_plugins:patient", "kwargs": {"parser": "tests.user_plugins:last_word", "retries": 0}},
        agent={"kind": "tool", "tools": ["tests.user_plugins:double", "calculator"]},
        reward={"functions": [{"kind": "tests.user_plugins:brevity", "kwargs": {"max_chars": 3}}]},
    )  # fmt: skip
    assert check_task(t, "feeder.tasks[0]") < 2.0


@pytest.mark.parametrize(
    "over, match",
    [
        ({"env": {"kind": "tests.user_plugins:CountDown"}},
         r"feeder.tasks\[0\] \(count\).env.kind=.*has no attribute 'CountDown'"),
        ({"env": {"kind": "tests.user_plugins:CountDownEnv", "kwargs": {"begin": 2}}},
         r"\(count\).env \(tests.user_plugins:CountDownEnv\): unknown keyword\(s\) \['begin'\]; known: \['start'\]"),
        ({"env": {"kind": "tests.user_plugins:CountDownEnv", "kwargs": {"start": 0}}},
         r"\(count\).env \(tests.user_plugins:CountDownEnv\): start=0 must be >= 1"),
        ({"env": {"kind": "tests.user_plugins:BrokenEnv"}},
         r"reset\(seed=0\) raised RuntimeError: the dataset file is missing"),
        ({"env": {"kind": "tests.user_plugins:double"}}, r"built a int, not a LudicEnv|missing required"),
        ({"protocol": {"kind": "single_agents"}},
         r"\(count\).protocol.kind='single_agents' is unknown; registered: \[multi_agent, single_agent\]; "
         r"did you mean 'single_agent'\?"),
        ({"protocol": {"kind": "single_agent", "kwargs": {"parser": {"kind": "xml"}}}},
         r"protocol: .*missing required keyword\(s\) \['tag'\]"),
        ({"protocol": {"kind": "single_agent", "kwargs": {"parser": "boxd"}}}, r"did you mean 'boxed'"),
        ({"protocol": {"kind": "single_agent", "kwargs": {"context": "ful"}}}, r"context.kind='ful'"),
        ({"protocol": {"kind": "single_agent", "kwargs": {"system_promt": "x"}}},
         r"unknown keyword\(s\) \['system_promt'\].*did you mean 'system_prompt'"),
        ({"agent": {"kind": "tool", "tools": ["calculater"]}}, r"did you mean 'calculator'"),
        ({"reward": {"functions": [{"kind": "tests.user_plugins:brevity", "kwargs": {"max": 1}}]}},
         r"reward.functions\[brevity\] \(tests.user_plugins:brevity\): unknown keyword\(s\) \['max'\]"),
        ({"reward": {"functions": [{"kind": "llm_jugde"}]}}, r"did you mean 'llm_judge'"),
        ({"envv": {}}, r"unknown key\(s\) \['envv'\]; valid keys"),
        ({"weight": 0}, r"weight=0 must be a number > 0"),
    ],
)  # fmt: skip
def test_a_bad_task_fails_naming_its_key_value_and_choices(over: dict[str, Any], match: str):
    with pytest.raises(PluginError, match=match):
        check_task(task(**over), "feeder.tasks[0]")


def test_reward_functions_built_only_where_they_score():
    # the verifier's key is the actors' secret: the feeder checks the keywords only
    t = task(reward={"functions": [{"kind": "http_verifier", "kwargs": {"url": "http://v", "api_key_env": "LUDIC_TEST_NO_SUCH_KEY"}}]})  # fmt: skip
    check_task(t, "feeder.tasks[0]", build_rewards=False)
    with pytest.raises(ValueError, match="api_key_env='LUDIC_TEST_NO_SUCH_KEY' is not set"):
        check_task(t, "feeder.tasks[0]", build_rewards=True)


def test_a_request_runs_only_if_it_is_one_of_the_tasks():
    tasks = parse_tasks(
        [OK, {**OK, "name": "count5", "env": {**OK["env"], "kwargs": {"start": 5}}}], "feeder.tasks"
    )
    ts = TaskSet(tasks)
    req = tasks[1].request(id="r", env_seed=3, sampling_seed=7, num_episodes=2, meta={"x": 1})
    assert ts.match(req) is tasks[1] and req.meta["task"] == "count5"
    from libludic import transport

    wire = transport.decode_request(transport.encode_request(req))  # after the round trip
    assert ts.match(wire) is tasks[1]
    import dataclasses

    from libludic.requests import EnvSpec

    assert ts.match(dataclasses.replace(req, env=EnvSpec("os:system"))) is None
    with pytest.raises(PluginError, match=r"task name\(s\) \['count'\] used twice"):
        parse_tasks([OK, OK], "feeder.tasks")


def test_task_failure_watch_counts_dead_letters_in_a_row_per_task():
    w = TaskFailureWatch(threshold=5)
    series = "ludic_actor_task_requests_total{{outcome={},task={}}}"

    def scrape(**counts: float) -> dict[str, float]:
        return {series.format(*k.split("__")): v for k, v in counts.items()}

    w.update({"a0": scrape(committed__add=3, deadlettered__bad=2)})
    w.update(
        {"a0": scrape(committed__add=6, deadlettered__bad=4), "a1": scrape(deadlettered__bad=1)}
    )
    assert w.streak == {"add": 0, "bad": 5} and w.failing() == [("bad", 5)]
    w.update({"a0": scrape(committed__bad=1, deadlettered__bad=9)})  # one committed: reset
    assert w.failing() == []
    # a restarted actor counts from 0 again: its new counts are new
    w.update({"a1": scrape(deadlettered__bad=0.0)})
    w.update({"a1": scrape(deadlettered__bad=5)})
    assert w.failing() == [("bad", 5)]
    assert TaskFailureWatch(0).failing() == []


def run_cli(*args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def test_ludic_check_and_up_refuse_a_misspelt_kind_in_seconds(tmp_path: Path):
    cfg = yaml.safe_load((ROOT / "examples/arith/grpo.yaml").read_text())
    cfg["feeder"]["tasks"][0]["env"]["kind"] = "arithmetik"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    code, out, took = run_cli("check", "--config", str(bad))
    assert code == 2, out
    assert (
        "feeder.tasks[0] (add2).env.kind='arithmetik' is unknown; registered: [arithmetic, " in out
        and "did you mean 'arithmetic'?" in out
    )
    code, out, took_up = run_cli("up", "--config", str(bad), "--runs-dir", str(tmp_path / "runs"))
    assert code == 2 and "env.kind='arithmetik' is unknown" in out, out
    assert not (tmp_path / "runs").exists()  # nothing was started
    print(f"ludic check: {took:.1f} s, ludic up: {took_up:.1f} s (bad kind to exit)")
    code, out, _ = run_cli("check", "--config", str(ROOT / "examples/tic_tac_toe/selfplay.yaml"))
    assert code == 0 and "ok  feeder.tasks[1] ttt-selfplay: env tic_tac_toe_2p" in out, out


def test_no_task_label_is_what_actors_count_strangers_under():
    assert NO_TASK == "(none)"
