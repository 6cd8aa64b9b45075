"""Every example run config is valid YAML whose ``up:`` settings load and whose feeder tasks
and held-out evaluation (env and protocol) build and run."""

from pathlib import Path

import pytest
import yaml

from libludic.registry import build_registries
from libludic.rollout.engine import RolloutEngine
from libludic.tasks import parse_tasks
from services.common.heldout import eval_requests
from services.launcher.settings import UpSettings
from tests.example_configs import ELSEWHERE, config_id, run_configs
from tests.fakes import ScriptedClient

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = run_configs()


def test_every_example_is_built_here_or_where_it_can_be():
    built = {p.parent.name for p in CONFIGS}
    assert built >= {"arith", "tic_tac_toe", "code_exec", "gsm8k", "smollm2", "custom_env"}
    assert built >= {"reasoning_gym", "textarena"}
    every = {p.parent.name for p in ROOT.glob("examples/*/*.yaml")}
    assert every == built | set(ELSEWHERE)


@pytest.mark.parametrize("path", CONFIGS, ids=config_id)
async def test_example_tasks_run_an_episode(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = yaml.safe_load(path.read_text())
    assert {"run_id", "up", "algorithm", "feeder", "actor", "learner"} <= set(cfg)
    eng = RolloutEngine(
        *build_registries(ScriptedClient(["<move>5</move> \\boxed{3} ```python\nprint(1)\n```"]))
    )
    # tasks parsed as the feeder parses them (protocol, agent: ...)
    tasks = parse_tasks(cfg["feeder"]["tasks"], "feeder.tasks")
    reqs = [
        t.request(id=f"r{i}", env_seed=1, sampling_seed=1, num_episodes=1)
        for i, t in enumerate(tasks)
    ]
    up = UpSettings(**cfg["up"])  # every key known, eval_protocol's parser built
    reqs += eval_requests(up.eval_env, 1, up.eval_max_tokens, up.eval_protocol)
    rollouts = await eng.generate_rollouts(reqs, max_steps=cfg["actor"].get("max_steps", 1))
    # one rollout per agent that acted (multi_agent: up to one per role), each with steps
    assert {r.meta["request_id"] for r in rollouts} == {q.id for q in reqs} and all(
        r.steps for r in rollouts
    )


def test_dataset_qa_spec_validation():
    from libludic.envs.dataset_qa_env import dataset_qa_env

    with pytest.raises(ValueError, match="exactly one of"):
        dataset_qa_env()
    with pytest.raises(ValueError, match="format"):
        dataset_qa_env(path="x", format="csv")
