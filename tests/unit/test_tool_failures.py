"""scripts/tool_failures.py's classification of tool-use episodes, on scripted episodes of
the calculator on 3-digit products (examples/tool_use)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from libludic.envs.arithmetic import generate_problem
from libludic.registry import build_registries
from libludic.requests import AgentSpec, EnvSpec, ProtocolSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from tests.fakes import ScriptedClient

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tool_failures.py"
_spec = importlib.util.spec_from_file_location("tool_failures", SCRIPT)
assert _spec is not None and _spec.loader is not None
tool_failures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool_failures)


def call(expr: str) -> str:
    return (
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'
    )


@pytest.mark.parametrize(
    "replies, kind",
    [
        ([call("{a}*{b}"), "{p}"], "pass"),
        ([call("{a}*{b}"), "{p}1"], "answer_wrong"),  # the result mis-copied
        ([call("{a}*{b}9"), "{p}"], "pass"),  # right anyway: the answer is what counts
        ([call("{a}*{b}9"), "1"], "call_wrong"),  # an operand mis-copied
        ([call("{a}*/{b}"), "1"], "call_wrong"),  # the tool failed
        (["{p}1"], "no_call"),  # answered without the tool
    ],
)
async def test_each_episode_gets_the_step_it_failed_at(replies: list[str], kind: str):
    q = generate_problem(3, digits=3, ops=("*",))

    def fill(r: str) -> str:
        return r.replace("{a}", str(q.a)).replace("{b}", str(q.b)).replace("{p}", q.answer)

    eng = RolloutEngine(*build_registries(ScriptedClient([fill(r) for r in replies])))
    req = RolloutRequest(
        env=EnvSpec("arithmetic", {"digits": 3, "ops": ["*"]}),
        env_seed=3,
        protocol=ProtocolSpec(agent=AgentSpec("tool", {"tools": ["calculator"]})),
    )
    (ro,) = await eng.generate_rollouts([req], max_steps=2)
    assert tool_failures.classify(ro) == kind
