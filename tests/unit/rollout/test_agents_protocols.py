import pytest

from libludic.agents.base_agent import Agent
from libludic.agents.react_agent import ReActAgent
from libludic.agents.tool_agent import Tool, ToolAgent
from libludic.envs.arithmetic import ArithmeticEnv, generate_problem
from libludic.envs.tic_tac_toe import TwoPlayerTicTacToeEnv
from libludic.interaction.multi_agent import MultiAgentProtocol
from libludic.interaction.single_agent import SingleAgentSyncProtocol
from libludic.parsers import xml_parser
from tests.fakes import ScriptedClient


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def test_single_agent_records_trace_reward_and_version():
    ans = generate_problem(5).answer
    client = ScriptedClient([ans], policy_version=3)
    proto = SingleAgentSyncProtocol(Agent(client))
    (r,) = await proto.run(ArithmeticEnv(), max_steps=2, env_seed=5)
    (s,) = r.steps
    assert s.reward == 1.0 and s.terminated and not s.truncated
    assert s.policy_version == 3
    assert s.trace is not None and s.trace.completion_token_ids == list(ans.encode()) + [258]
    assert s.info["env_reward"] == 1.0 and s.info["parse_error"] is False


async def test_parse_failure_gives_penalty_feedback_and_does_not_step_env():
    env = ArithmeticEnv()
    ans = generate_problem(1).answer
    client = ScriptedClient(["no tags", f"<answer>{ans}</answer>"])
    proto = SingleAgentSyncProtocol(
        Agent(client, parser=xml_parser("answer", success_reward=0.1, error_reward=-0.5))
    )
    (r,) = await proto.run(env, max_steps=3, env_seed=1)
    first, second = r.steps
    assert (
        first.reward == -0.5 and first.info["parse_error"] and "<answer>" in (first.next_obs or "")
    )
    # the feedback went back to the model as the next user message
    assert client.requests[1].messages[-1]["content"] == first.next_obs
    # 1.0 env reward + 0.1 format reward
    assert second.reward == pytest.approx(1.1) and second.terminated


async def test_max_steps_marks_truncation():
    client = ScriptedClient(["bad"])
    proto = SingleAgentSyncProtocol(Agent(client, parser=xml_parser("answer")))
    (r,) = await proto.run(ArithmeticEnv(), max_steps=2, env_seed=0)
    assert len(r.steps) == 2 and r.steps[-1].truncated
    assert r.steps[-1].info["truncation_reason"] == "max_steps"


async def test_stop_on_parse_error():
    proto = SingleAgentSyncProtocol(
        Agent(ScriptedClient(["bad"]), parser=xml_parser("a")), stop_on_parse_error=True
    )
    (r,) = await proto.run(ArithmeticEnv(), max_steps=5, env_seed=0)
    assert len(r.steps) == 1 and r.steps[0].info["truncation_reason"] == "parse_error"


async def test_single_agent_protocol_rejects_multi_agent_env():
    proto = SingleAgentSyncProtocol(Agent(ScriptedClient(["1"])))
    with pytest.raises(ValueError, match="MultiAgentProtocol"):
        await proto.run(TwoPlayerTicTacToeEnv(), max_steps=1)


def test_tool_schema_and_argument_validation():
    t = Tool.from_function(add)
    assert t.parameters["required"] == ["a", "b"] and t.parameters["properties"]["a"] == {
        "type": "integer"
    }
    assert t.validate({"a": 1, "b": 2}) == {"a": 1, "b": 2}
    for bad, msg in [
        ({"a": 1}, "missing"),
        ({"a": 1, "b": "2"}, "must be integer"),
        ({"a": 1, "b": 2, "c": 3}, "unknown"),
        ([1], "JSON object"),
    ]:
        with pytest.raises(ValueError, match=msg):
            t.validate(bad)


async def test_tool_agent_runs_tools_then_answers_and_each_call_is_a_step():
    ans = generate_problem(2).answer
    client = ScriptedClient(
        [
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
            '<tool_call>{"name": "add", "arguments": {"a": "x", "b": 3}}</tool_call>',
            ans,
        ]
    )
    agent = ToolAgent(client, tools=[add])
    (r,) = await SingleAgentSyncProtocol(agent).run(ArithmeticEnv(), max_steps=1, env_seed=2)
    assert [s.info["kind"] for s in r.steps] == ["tool_call", "tool_call", "action"]
    assert r.steps[0].next_obs == "add: 5"
    assert "must be integer" in (r.steps[1].next_obs or "")
    assert r.steps[2].reward == 1.0 and all(s.trace is not None for s in r.steps)
    # the tool result reached the model as a tool message
    assert {"role": "tool", "content": "add: 5"} in client.requests[1].messages


async def test_tool_agent_caps_tool_rounds():
    client = ScriptedClient(
        ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>']
    )
    agent = ToolAgent(client, tools=[add], max_tool_rounds=2)
    (r,) = await SingleAgentSyncProtocol(agent).run(ArithmeticEnv(), max_steps=1, env_seed=0)
    assert len(client.requests) == 3 and len(r.steps) == 3


async def test_react_agent_requires_think_prefix():
    client = ScriptedClient(["no think", "<think>ok</think>" + generate_problem(4).answer])
    agent = ReActAgent(client)
    (r,) = await SingleAgentSyncProtocol(agent).run(ArithmeticEnv(), max_steps=2, env_seed=4)
    assert r.steps[0].info["parse_error"] and r.steps[1].reward == 1.0
    assert client.requests[0].messages[0]["role"] == "system"


async def test_multi_agent_protocol_zero_sum_rollouts():
    x = ScriptedClient(["1", "2", "3"])
    o = ScriptedClient(["4", "5"])
    proto = MultiAgentProtocol({"X": Agent(x), "O": Agent(o)})
    rs = await proto.run(TwoPlayerTicTacToeEnv(), max_steps=9)
    by = {r.meta["agent_id"]: r for r in rs}
    assert by["X"].total_reward == 1.0 and by["O"].total_reward == -1.0
    assert len(by["X"].steps) == 3 and len(by["O"].steps) == 2
    # O lost on X's move: the -1 lands on O's last step, which is marked terminated
    assert by["O"].steps[-1].terminated


async def test_multi_agent_protocol_needs_agent_per_role():
    with pytest.raises(ValueError, match="no agent given"):
        await MultiAgentProtocol({"X": Agent(ScriptedClient(["1"]))}).run(
            TwoPlayerTicTacToeEnv(), max_steps=1
        )


async def test_a_prompt_past_the_context_ends_the_episode_not_the_request():
    # CountDown from 9 answered right every turn: the dialog grows by one exchange a turn
    # (prompts of 12, 36, 60, 84 bytes); with a 70-byte context the fourth no longer fits. The three steps played stay
    # (training uses them); the last is truncated with the reason. A first prompt that does
    # not fit is the task's error and raises.
    from libludic.inference.client import ContextLengthExceeded
    from tests.user_plugins import CountDownEnv

    answers = iter(["9", "8", "7", "6", "5"])
    client = ScriptedClient([lambda req: next(answers)], context=70)
    (r,) = await SingleAgentSyncProtocol(Agent(client)).run(CountDownEnv(9), max_steps=9)
    assert [s.action for s in r.steps] == ["9", "8", "7"]
    assert r.steps[-1].truncated and r.steps[-1].info["truncation_reason"] == "context_length"
    assert r.total_reward == 3.0
    with pytest.raises(ContextLengthExceeded):
        await SingleAgentSyncProtocol(Agent(ScriptedClient(["9"], context=5))).run(
            CountDownEnv(9), max_steps=2
        )


async def test_a_full_context_ends_a_multi_agent_game_for_every_role():
    # X's prompts are 156, 253 and 350 bytes: with a 300-byte context its third does not fit
    x = ScriptedClient(["1", "2", "3"], context=300)
    o = ScriptedClient(["4", "5"])
    rs = await MultiAgentProtocol({"X": Agent(x), "O": Agent(o)}).run(
        TwoPlayerTicTacToeEnv(), max_steps=9
    )
    by = {r.meta["agent_id"]: r for r in rs}
    assert len(by["X"].steps) == 2 and len(by["O"].steps) == 2
    assert all(r.steps[-1].info["truncation_reason"] == "context_length" for r in rs)
