import pytest

from libludic.context.full_dialog import FullDialog
from libludic.context.truncated_thinking import TruncatedThinkingContext
from libludic.types import ChatResponse


def test_full_dialog_keeps_history_with_system_prompt():
    c = FullDialog()
    c.reset("sys")
    c.on_env_reset("q1", {})
    c.on_after_act(ChatResponse(text="a1"))
    c.on_after_step("q2", {})
    assert c.on_before_act() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    c.reset(None)
    assert c.on_before_act() == []


def test_truncated_thinking_cuts_old_thinking_but_keeps_latest():
    c = TruncatedThinkingContext(max_thinking_chars=3, placeholder="~")
    c.reset(None)
    c.on_env_reset("q", {})
    c.on_after_act(ChatResponse(text="<think>abcdefg</think>move 1"))
    c.on_after_step("q2", {})
    c.on_after_act(ChatResponse(text="<think>hijklmn</think>move 2"))
    msgs = c.on_before_act()
    assert msgs[1]["content"] == "<think>abc~</think>move 1"
    assert msgs[3]["content"] == "<think>hijklmn</think>move 2"


def test_truncated_thinking_rejects_negative_budget():
    with pytest.raises(ValueError):
        TruncatedThinkingContext(max_thinking_chars=-1)


def test_a_context_strategy_takes_its_keyword_arguments_from_plain_data() -> None:
    from libludic.context.config import make_context

    ctx = make_context({"kind": "truncated_thinking", "kwargs": {"max_thinking_chars": 3}})
    assert isinstance(ctx, TruncatedThinkingContext) and ctx.max_thinking_chars == 3
    assert type(make_context("full")).__name__ == "FullDialog"
    with pytest.raises(
        ValueError,
        match=r"unknown keyword\(s\) \['max_chars'\]; known: \['max_thinking_chars', "
        r"'placeholder'\]",
    ):
        make_context({"kind": "truncated_thinking", "kwargs": {"max_chars": 3}})
    with pytest.raises(ValueError, match="context.kind='ful' is unknown; .*did you mean 'full'"):
        make_context("ful")


async def test_latest_observation_shows_the_current_state_only():
    # CountDown from 3, answered right: with `latest` every prompt is [system, user: the
    # current observation], the same length at every turn; a tool call and its result stay
    # until the env steps
    from libludic.agents.base_agent import Agent
    from libludic.context.config import make_context
    from libludic.interaction.single_agent import SingleAgentSyncProtocol
    from tests.fakes import ScriptedClient
    from tests.user_plugins import CountDownEnv

    client = ScriptedClient(["3", "2", "1"])
    proto = SingleAgentSyncProtocol(Agent(client, ctx=make_context("latest")), system_prompt="S")
    (r,) = await proto.run(CountDownEnv(3), max_steps=3)
    assert r.total_reward == 3.0
    assert [m["content"] for m in client.requests[2].messages] == ["S", "Say 1."]
    ctx = make_context("latest")
    ctx.reset(None)
    ctx.on_env_reset("board", {})
    ctx.add_message({"role": "tool", "content": "calculator: 4"})
    assert [m["role"] for m in ctx.on_before_act()] == ["user", "tool"]
    ctx.on_after_step("next board", {})
    assert ctx.on_before_act() == [{"role": "user", "content": "next board"}]
