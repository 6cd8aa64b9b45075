"""The arithmetic task asked of a chat model: the env's ``prompt`` template, and the regex
parser that takes the last integer of a sentence, which the env then scores exactly."""

from __future__ import annotations

import pytest

from libludic.envs.arithmetic import ArithmeticEnv, generate_problem
from libludic.parsers import make_parser
from libludic.registry import build_registries
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from tests.fakes import ScriptedClient

PROMPT = "What is {a} + {b}? Answer with just the number."
LAST_INTEGER = {"kind": "regex", "pattern": r"(-?\d+)\D*$"}


def reset_obs(env: ArithmeticEnv, seed: int) -> str:
    ((obs, _),) = env.reset(seed=seed).values()
    return obs


def test_prompt_fills_operands_and_keeps_other_braces():
    # generate_problem(4, digits=1) draws a=3, b=4 (answer 7)
    p = generate_problem(4, digits=1)
    assert (p.a, p.op, p.b, p.answer, p.question) == (3, "+", 4, "7", "3+4=")
    env = ArithmeticEnv(digits=1, prompt="What is {a} + {b}? Put the final answer in \\boxed{}.")
    assert reset_obs(env, 4) == "What is 3 + 4? Put the final answer in \\boxed{}."
    assert env.env_current_obs() == "What is 3 + 4? Put the final answer in \\boxed{}."


def test_prompt_op_field_names_the_drawn_operator():
    # with ops ("+", "-"), seed 5 draws 9 and 4, then "-" (9-4 = 5); seed 0 draws 6+6 = 12
    env = ArithmeticEnv(digits=1, ops=("+", "-"), prompt="Compute {a} {op} {b}.")
    assert reset_obs(env, 5) == "Compute 9 - 4."
    assert reset_obs(env, 0) == "Compute 6 + 6."


def test_no_prompt_keeps_the_bare_question():
    assert reset_obs(ArithmeticEnv(digits=1), 4) == "3+4="


@pytest.mark.parametrize(
    "prompt, ops, match",
    [
        ("What is {a}?", ("+",), r"lacks \{b\}"),
        ("{a} and {b}", ("+", "*"), r"lacks \{op\}"),
        ("{a} + {b} = {c}", ("+",), r"unknown field\(s\) \['c'\]"),
    ],
)
def test_a_prompt_that_cannot_state_the_problem_is_refused(prompt, ops, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticEnv(ops=ops, prompt=prompt)


@pytest.mark.parametrize(
    "reply, action",
    [
        ("3 + 4 = 7", "7"),
        ("The answer is 7.", "7"),
        ("7", "7"),
        ("3 + 4 = 7\n", "7"),
        ("4 + 3 = 7, not 8", "8"),  # the last integer is the answer, by this rule
        ("-2 apples", "-2"),
    ],
)
def test_last_integer_parser(reply, action):
    got = make_parser(LAST_INTEGER)(reply)
    assert got.action == action and got.reward == 0.0


def test_last_integer_parser_fails_without_a_number():
    got = make_parser(LAST_INTEGER)("I do not know.")
    assert got.action is None and got.reward == -1.0


@pytest.mark.parametrize(
    "reply, reward, parse_error",
    [
        ("3 + 4 = 7", 1.0, False),  # "7" extracted, equal to the answer 7
        ("The answer is 8.", 0.0, False),  # "8" extracted, scored 0
        ("Seven.", -1.0, True),  # nothing to extract: the parser's error_reward
    ],
)
async def test_task_config_reaches_env_and_agent(reply, reward, parse_error):
    """A task of plain data (what a run config's feeder and eval send) prompts with the
    template and scores what the parser extracted."""
    client = ScriptedClient([reply])
    engine = RolloutEngine(*build_registries(client))
    req = RolloutRequest(
        env=EnvSpec("arithmetic", {"digits": 1, "prompt": PROMPT}),
        protocol=ProtocolSpec("single_agent", {"parser": LAST_INTEGER}),
        env_seed=4,  # 3 + 4
    )
    (r,) = await engine.generate_rollouts([req], max_steps=1)
    (step,) = r.steps
    assert (
        client.requests[0].messages[-1]["content"] == "What is 3 + 4? Answer with just the number."
    )
    assert step.reward == reward and step.info["parse_error"] is parse_error
