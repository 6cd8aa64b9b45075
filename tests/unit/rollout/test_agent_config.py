"""Agents chosen from config: `agent: {kind: plain|tool|react|pkg.mod:Class, ...}` in a
feeder task reaches the actor's protocol through the request, and bad values fail at the
feeder's start-up with the choices."""

import json

import pytest

from libludic import transport
from libludic.agents.base_agent import Agent
from libludic.agents.react_agent import ReActAgent
from libludic.agents.tool_agent import ToolAgent
from libludic.agents.tools import calculator
from libludic.envs.arithmetic import generate_problem
from libludic.registry import build_registries
from libludic.requests import AgentSpec, EnvSpec, ProtocolSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from libludic.tasks import TaskSpec
from services.feeder.settings import FeederSettings
from services.feeder.worker import make_request
from tests.fakes import ScriptedClient


def feeder_request(task: dict) -> RolloutRequest:
    """The request exactly as an actor sees it: feeder task -> request -> codec -> request."""
    s = FeederSettings(tasks=[task], algorithm={"name": "grpo", "group_size": 1}, metrics_port=0)
    req = make_request(s, s.parsed_tasks[0], seed=3)
    return transport.decode_request(transport.encode_request(req))


def built_agents(task: dict) -> list:
    _, proto_reg, _ = build_registries(ScriptedClient(["1"]))
    req = feeder_request(task)
    extra = {} if req.protocol.agent is None else {"agent": req.protocol.agent}
    proto = proto_reg[req.protocol.kind](inference=req.inference, **req.protocol.kwargs, **extra)
    return list(proto.agents.values()) if hasattr(proto, "agents") else [proto.agent]


@pytest.mark.parametrize("kind,cls", [("plain", Agent), ("tool", ToolAgent), ("react", ReActAgent)])
def test_task_agent_kind_reaches_the_protocol_through_the_request(kind, cls):
    agent = (
        {"kind": kind}
        if kind == "plain"
        else {"kind": kind, "tools": ["calculator"], "max_tool_rounds": 2}
    )
    (a,) = built_agents({"env": {"kind": "arithmetic"}, "agent": agent})
    assert type(a) is cls
    if kind != "plain":
        assert list(a.tools) == ["calculator"] and a.max_tool_rounds == 2


def test_no_agent_key_builds_a_plain_agent_and_keeps_the_wire_unchanged():
    req = feeder_request({"env": {"kind": "arithmetic"}})
    assert req.protocol.agent is None and "agent" not in req.protocol.to_dict()
    (a,) = built_agents({"env": {"kind": "arithmetic"}})
    assert type(a) is Agent


def test_multi_agent_builds_one_agent_of_the_kind_per_role():
    agents = built_agents(
        {
            "env": {"kind": "tic_tac_toe_2p"},
            "protocol": {"kind": "multi_agent", "kwargs": {"roles": ["X", "O"]}},
            "agent": {"kind": "react"},
        }
    )
    assert [type(a) for a in agents] == [ReActAgent, ReActAgent] and agents[0] is not agents[1]


@pytest.mark.parametrize(
    "agent,match",
    [
        (
            {"kind": "planer"},
            r"agent.kind='planer' is unknown; registered: \[plain, react, tool\]; did you "
            r"mean 'plain'\?",
        ),
        (
            {"kind": "plain", "tools": ["python"]},
            r"agent \(plain\): unknown keyword\(s\) \['tools'\]; known: none",
        ),
        (
            {"kind": "tool", "tools": ["python"], "max_tool_round": 2},
            r"unknown keyword\(s\) \['max_tool_round'\]; known: \['tools', 'max_tool_rounds', 'describe_tools'\]; "
            r"did you mean 'max_tool_rounds'\?",
        ),
        (
            {"kind": "tool", "tools": ["bash"]},
            r"agent.tools\[0\]='bash' is unknown; registered: \[.*calculator, python\]",
        ),
        (
            {"kind": "tool", "tools": ["no_such_pkg.tools:grep"]},
            r"agent.tools\[0\]='no_such_pkg.tools:grep': cannot import 'no_such_pkg.tools'",
        ),
        ({"kind": "tool"}, r"needs tools=\[...\]"),
        ({"kind": "tool", "tools": "python"}, r"must be a list of tool kinds"),
        ({"kind": "react", "max_tool_rounds": -1}, r"max_tool_rounds=-1 must be an integer >= 0"),
        ({"kind": "react", "think_error_reward": "x"}, r"think_error_reward='x' must be a number"),
        (
            {"kind": "os:system"},
            r"agent.kind='os:system' names <built-in function system>, not an Agent",
        ),
    ],
)
def test_bad_agent_config_fails_at_feeder_startup_naming_value_and_choices(agent, match):
    with pytest.raises(ValueError, match=r"feeder.tasks\[0\] \(arithmetic\).protocol: .*" + match):
        FeederSettings(tasks=[{"env": {"kind": "arithmetic"}, "agent": agent}], metrics_port=0)


def test_feeder_task_rejects_unknown_keys_and_a_doubled_agent():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['agnet'\]; valid keys: .*'agent'"):
        TaskSpec.from_dict({"env": {"kind": "arithmetic"}, "agnet": {"kind": "tool"}})
    with pytest.raises(ValueError, match="sets agent twice"):
        TaskSpec.from_dict(
            {
                "env": {"kind": "arithmetic"},
                "agent": {"kind": "plain"},
                "protocol": {"kind": "single_agent", "agent": {"kind": "plain"}},
            }
        )


def test_an_agent_class_of_the_users_by_import_path():
    # a user's Agent subclass, named by its import path, with a keyword of its own
    (a,) = built_agents(
        {
            "env": {"kind": "arithmetic"},
            "agent": {"kind": "tests.user_plugins:EchoAgent", "prefix": ">"},
        }
    )
    assert type(a).__name__ == "EchoAgent" and a.prefix == ">"


def test_agent_spec_round_trips_flat():
    spec = AgentSpec.from_dict({"kind": "react", "tools": ["python"], "think_error_reward": -0.5})
    assert spec.kwargs == {"tools": ["python"], "think_error_reward": -0.5}
    assert AgentSpec.from_dict(spec.to_dict()) == spec
    assert ProtocolSpec.from_dict(ProtocolSpec(agent=spec).to_dict()).agent == spec


async def test_tool_agent_from_config_calls_its_tool_in_an_episode():
    # 7 + 5: the scripted model asks the calculator, then answers with the tool's result
    q = generate_problem(4)

    def reply(req):
        last = req.messages[-1]
        if last["role"] == "tool":
            return last["content"].split(": ", 1)[1]
        a, b = last["content"][:-1].split("+")
        call = {"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"

    client = ScriptedClient([reply])
    eng = RolloutEngine(*build_registries(client))
    req = RolloutRequest(
        env=EnvSpec("arithmetic"),
        env_seed=4,
        protocol=ProtocolSpec(agent=AgentSpec("tool", {"tools": ["calculator"]})),
    )
    (ro,) = await eng.generate_rollouts([req], max_steps=2)
    tool_step, answer = ro.steps
    assert tool_step.info["kind"] == "tool_call" and tool_step.next_obs == f"calculator: {q.answer}"
    assert answer.action == q.answer and answer.reward == 1.0
    # the model was told about the tool in its system prompt
    system = client.requests[0].messages[0]
    assert system["role"] == "system" and '"name": "calculator"' in system["content"]


def test_builtin_tools():
    assert calculator("2 + 3 * (4 - 1)") == "11" and calculator("7 // 2") == "3"
    with pytest.raises(ValueError, match="unsupported"):
        calculator("__import__('os')")
    with pytest.raises(ValueError, match="too large"):
        calculator("2 ** 1000")
    schema = (
        ToolAgent(ScriptedClient(["x"]), tools=[calculator]).tools["calculator"].openai_schema()
    )
    assert json.loads(json.dumps(schema))["function"]["parameters"]["required"] == ["expression"]


def test_python_tool_runs_code_in_the_sandbox():
    from libludic.agents.tools import python

    out = python("import sys; print(int(sys.stdin.read()) * 2)", stdin="21")
    assert out.startswith("status: ok") and "\n42\n" in out
    assert "status: timeout" in python("while True: pass")


async def test_protocol_steps_an_async_env_without_blocking_the_loop():
    # CodeExecEnv.astep runs the tests in a worker thread; the protocol must await it
    # rather than call the blocking step() on the event loop
    from libludic.envs.arithmetic import ArithmeticEnv
    from libludic.interaction.single_agent import SingleAgentSyncProtocol

    class AsyncOnlyEnv(ArithmeticEnv):
        def step(self, actions):
            raise AssertionError("blocking step() called on the event loop")

        async def astep(self, actions):
            return ArithmeticEnv.step(self, actions)

    ans = generate_problem(1).answer
    (ro,) = await SingleAgentSyncProtocol(Agent(ScriptedClient([ans]))).run(
        AsyncOnlyEnv(), max_steps=1, env_seed=1
    )
    assert ro.steps[0].reward == 1.0
