"""The public API keeps the names and shapes the library's API spec documents
(ludic-training.md, ludic-architecture.md, ludic-configuration.md); each test quotes the
spec's line it holds to. tests/unit/test_spec_examples.py runs the spec's example code."""

import inspect

import pytest

from libludic.agents.base_agent import Agent
from libludic.agents.tool_agent import ToolAgent
from libludic.envs.arithmetic import generate_problem
from libludic.parsers import xml_parser
from libludic.registry import build_registries
from libludic.requests import EnvSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from libludic.training.config import TrainerConfig
from libludic.training.presets import make_reinforce
from tests.fakes import ScriptedClient


def test_generate_batch_positional_order_is_the_specs():
    # spec: generate_batch(self, requests, algorithm, sample_filter=None)
    params = list(inspect.signature(RolloutEngine.generate_batch).parameters)
    assert params[:4] == ["self", "requests", "algorithm", "sample_filter"]


async def test_generate_batch_third_positional_argument_is_the_sample_filter():
    ans = generate_problem(0).answer
    eng = RolloutEngine(*build_registries(ScriptedClient([ans])))
    reqs = [RolloutRequest(env=EnvSpec("arithmetic"), env_seed=0, num_episodes=3)]
    # env seeds 0, 1, 2 (same_env_seed off); the model always answers problem 0, so only
    # episode 0 is right: rewards 1, 0, 0; REINFORCE weight = return G_0 = r_0, so a
    # filter keeping weight > 0 keeps 1 of the 3 items.
    batch = await eng.generate_batch(reqs, make_reinforce(), lambda it: it.weight > 0)
    assert batch.meta["num_rollouts"] == 3 and len(batch.items) == 1
    assert batch.items[0].weight == pytest.approx(1.0)


async def test_agent_act_returns_action_and_info():
    # spec: Agent.act() -> (action, info)
    client = ScriptedClient(["<answer>42</answer>", "no tags"])
    agent = Agent(client, parser=xml_parser("answer", error_reward=-0.5))
    agent.reset()
    agent.on_env_reset("q?", {})
    action, info = await agent.act()
    assert action == "42"
    assert info["parsed"].action == "42" and info["response"].text == "<answer>42</answer>"
    assert len(info["turns"]) == 1
    action, info = await agent.act()
    assert action is None and info["parsed"].reward == -0.5 and "<answer>" in info["parsed"].obs


async def test_tool_agent_act_returns_action_and_info():
    client = ScriptedClient(
        ['<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>', "2"]
    )
    from libludic.agents.tools import calculator

    agent = ToolAgent(client, tools=[calculator])
    agent.reset()
    agent.on_env_reset("1+1=", {})
    action, info = await agent.act()
    assert action == "2" and len(info["turns"]) == 2
    assert info["turns"][0].tool_messages == [{"role": "tool", "content": "calculator: 2"}]


def test_trainer_config_accepts_learning_rate():
    # spec example: TrainerConfig(learning_rate=2e-5); spec table: lr (default 1e-5)
    assert TrainerConfig(learning_rate=2e-5).lr == 2e-5
    assert TrainerConfig(lr=3e-5).lr == 3e-5
    assert TrainerConfig().lr == 1e-5 and type(TrainerConfig().lr) is float
    assert TrainerConfig(lr=2e-5, learning_rate=2e-5).lr == 2e-5
    assert TrainerConfig(learning_rate=2e-5).to_dict()["lr"] == 2e-5
    assert "learning_rate" not in TrainerConfig().to_dict()  # one canonical field


def test_trainer_config_lr_and_learning_rate_disagreeing_is_an_error():
    with pytest.raises(ValueError, match=r"lr=3e-05 and learning_rate=2e-05.*pass one of them"):
        TrainerConfig(lr=3e-5, learning_rate=2e-5)
    # an explicit lr equal to the default still counts as given
    with pytest.raises(ValueError, match="pass one of them"):
        TrainerConfig(lr=1e-5, learning_rate=2e-5)
    with pytest.raises(ValueError, match=r"TrainerConfig.lr=0.0 must be > 0"):
        TrainerConfig(learning_rate=0.0)


def test_runtime_device_other_than_model_device_is_rejected_with_the_reason():
    assert TrainerConfig(model_device="cpu", runtime_device="cpu").runtime_device == "cpu"
    assert TrainerConfig(model_device="cpu").runtime_device is None
    with pytest.raises(
        ValueError,
        match=r"runtime_device='cuda:1' differs from model_device='cpu'.*inference service",
    ):
        TrainerConfig(model_device="cpu", runtime_device="cuda:1")


def test_the_specs_example_imports_work() -> None:
    """ludic-training.md's example loop and filters, under the package's name (libludic)."""
    import libludic.training as training
    from libludic.training import (  # noqa: F401
        RolloutBatchSource,
        RolloutEngine,
        Trainer,
        TrainerConfig,
        make_dr_grpo,
        make_grpo,
        make_gspo,
    )
    from libludic.training.filters import (  # noqa: F401
        combine,
        drop_incomplete_completions,
        drop_parse_errors,
        drop_truncated,
    )

    for name in training.__all__:  # every lazy export resolves
        assert getattr(training, name) is not None, name
