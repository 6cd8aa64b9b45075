"""Reward functions composed with the env's reward (libludic/scoring):
``r = env_weight * r_env + sum_i weight_i * f_i(sample)``, added on the last step."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from libludic.registry import build_registries
from libludic.requests import EnvSpec, RewardFnSpec, RewardSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from libludic.scoring.base import RewardError, RewardInput, build_reward_fn
from libludic.scoring.judge import LLMJudge
from libludic.scoring.remote import HTTPVerifier
from tests.fakes import ScriptedClient, make_rollout

COUNT3 = EnvSpec("tests.user_plugins:CountDownEnv", {"start": 3})


async def run(reward: RewardSpec | None, replies: list[str], max_steps: int = 3) -> Any:
    eng = RolloutEngine(*build_registries(ScriptedClient(replies)))
    req = RolloutRequest(env=COUNT3, env_seed=0, reward=reward)
    (ro,) = await eng.generate_rollouts([req], max_steps=max_steps)
    return ro


async def test_scores_add_to_the_last_step_and_env_rewards_are_scaled():
    # CountDown 3: "3", "2", "1" earn 1 each (env total 3). brevity(max_chars=10) of "1" is 1,
    # async_bonus (a parsed answer) 0.5, Matches (answer "1" == info["reference"] "1") 1:
    #   steps: 0.5*1, 0.5*1, 0.5*1 + (2*1 + 1*0.5 + 3*1)  ->  total 0.5*3 + 5.5 = 7.0
    spec = RewardSpec(
        env_weight=0.5,
        functions=(
            RewardFnSpec("tests.user_plugins:brevity", {"max_chars": 10}, weight=2.0),
            RewardFnSpec("tests.user_plugins:async_bonus", weight=1.0),
            RewardFnSpec("tests.user_plugins:Matches", weight=3.0, name="exact"),
        ),
    )
    ro = await run(spec, ["3", "2", "1"])
    assert [s.reward for s in ro.steps] == pytest.approx([0.5, 0.5, 0.5 + 5.5])
    assert ro.total_reward == pytest.approx(7.0)
    assert ro.steps[-1].info["reward_fns"] == {"brevity": 1.0, "async_bonus": 0.5, "exact": 1.0}
    # the rollout without reward functions: the env's own 3
    assert (await run(None, ["3", "2", "1"])).total_reward == 3.0


async def test_a_failing_reward_function_fails_the_episode_naming_it():
    spec = RewardSpec(functions=(RewardFnSpec("tests.user_plugins:broken_reward"),))
    with pytest.raises(
        RewardError, match=r"broken_reward .*raised ConnectionError: verifier unreachable"
    ):
        await run(spec, ["3", "2", "1"])


@pytest.mark.parametrize(
    "spec, match",
    [
        (RewardFnSpec("tests.user_plugins:brevity", {"max_char": 3}), r"unknown keyword\(s\) \['max_char'\]"),
        (RewardFnSpec("nope"), r"reward.functions\[nope\].kind='nope' is unknown; registered: \[.*http_verifier, llm_judge, tool_result\]"),
        (RewardFnSpec("llm_judge", {"template": "no completion field"}), r"must contain \{completion\}"),
        (RewardFnSpec("http_verifier", {"url": "ftp://x"}), r"must be an http\(s\) URL"),
    ],
)  # fmt: skip
def test_a_bad_reward_function_fails_when_built(spec: RewardFnSpec, match: str):
    with pytest.raises(ValueError, match=match):
        build_reward_fn(spec, client=ScriptedClient(["x"]))


def test_a_reward_function_returning_a_non_number_is_an_error():
    async def go() -> None:
        fn = build_reward_fn(RewardFnSpec("tests.user_plugins:Matches", {"key": "k"}), None)
        ro = make_rollout("r", [1.0])
        assert await fn(RewardInput.of(ro)) == 0.0

        def nan(sample: RewardInput) -> float:
            return float("nan")

        import tests.user_plugins as up

        up.nan_reward = nan  # type: ignore[attr-defined]
        bad = build_reward_fn(RewardFnSpec("tests.user_plugins:nan_reward"), None)
        with pytest.raises(RewardError, match="returned nan; it must return a finite number"):
            await bad(RewardInput.of(ro))

    asyncio.run(go())


def test_reward_specs_check_their_shape():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['weights'\]"):
        RewardSpec.from_dict({"functions": [{"kind": "x", "weights": 2}]})
    with pytest.raises(ValueError, match="share the name"):
        RewardSpec.from_dict({"functions": [{"kind": "a:f"}, {"kind": "b:f"}]})
    with pytest.raises(ValueError, match="env_weight='x' must be a finite number"):
        RewardSpec.from_dict({"env_weight": "x"})
    spec = RewardSpec.from_dict({"functions": [{"kind": "pkg.mod:score", "weight": 2}]})
    assert spec.functions[0].name == "score" and RewardSpec.from_dict(spec.to_dict()) == spec


async def test_llm_judge_reads_its_verdict_from_the_run_client():
    client = ScriptedClient(["Yes, it is right.", "no", "7", "maybe"])
    judge = LLMJudge(client=client, template="Q: {prompt} A: {completion} R: {reference}")
    ro = make_rollout("r", [0.0])
    ro.steps[0].info["reference"] = "42"
    sample = RewardInput.of(ro)
    assert [await judge(sample) for _ in range(4)] == [1.0, 0.0, 0.7, 0.0]
    sent = client.requests[0]
    assert sent.sampling.temperature == 0.0 and "R: 42" in sent.messages[0]["content"]
    strict = LLMJudge(client=ScriptedClient(["perhaps"]), unparsed_score=None)
    with pytest.raises(RewardError, match="cannot read a verdict"):
        await strict(sample)


class _Verifier(BaseHTTPRequestHandler):
    fails = 0  # answer 503 this many times first
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Verifier.seen.append(body)
        if _Verifier.fails > 0:
            _Verifier.fails -= 1
            self.send_response(503)
            self.end_headers()
            return
        reply = {"reward": 1.0 if body["completion"] == "1" else 0.25}
        if body["completion"] == "bad":
            reply = {"score": 1}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a: Any) -> None:
        pass


@pytest.fixture
def verifier():
    srv = HTTPServer(("127.0.0.1", 0), _Verifier)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Verifier.seen.clear()
    yield f"http://127.0.0.1:{srv.server_address[1]}/score"
    srv.shutdown()


async def test_http_verifier_retries_then_scores(verifier: str):
    v = HTTPVerifier(verifier, retries=2, backoff_s=0.01)
    ro = make_rollout("r", [0.0])
    ro.steps[0].action = "1"
    ro.meta.update(task="count", env_seed=5)
    _Verifier.fails = 2  # two 503s, then the answer: within retries=2
    assert await v(RewardInput.of(ro)) == 1.0
    assert len(_Verifier.seen) == 3 and _Verifier.seen[-1]["task"] == "count"
    assert _Verifier.seen[-1]["env_seed"] == 5
    _Verifier.fails = 3  # one more than it retries
    with pytest.raises(RewardError, match="failed after 3 attempts: HTTP 503"):
        await v(RewardInput.of(ro))
    ro.steps[0].action = "bad"
    _Verifier.fails = 0
    with pytest.raises(RewardError, match=r"is not \{\"reward\": <number>\}"):
        await v(RewardInput.of(ro))


async def test_http_verifier_that_is_down_fails_after_its_retries():
    v = HTTPVerifier("http://127.0.0.1:9/score", retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(RewardError, match="failed after 2 attempts: ConnectError"):
        await v(RewardInput.of(make_rollout("r", [0.0])))


@pytest.mark.parametrize(
    "call, answer, want",
    [
        ("{a}*{b}", "{p}", [0.0, 1.0 + 0.5]),  # the call and the answer right: 1 + 0.5 x 1
        ("{a}*{b}", "1", [0.0, 0.0 + 0.5]),  # the call right, the answer wrong: 0.5 x 1
        ("{a}*{b}1", "{p}", [0.0, 1.0 + 0.0]),  # an operand mis-copied; the answer right
        ("{a}*/{b}", "{p}", [0.0, 1.0 + 0.0]),  # the tool failed ("error: ...")
    ],
)
async def test_tool_result_rewards_a_tool_call_that_returned_the_reference(
    call: str, answer: str, want: list[float]
):
    # 3-digit products with the calculator (examples/tool_use): the tool step is the first
    from libludic.envs.arithmetic import generate_problem
    from libludic.requests import AgentSpec, ProtocolSpec

    q = generate_problem(7, digits=3, ops=("*",))
    fill = {"a": q.a, "b": q.b, "p": q.answer}
    expr = call.format(**fill)
    replies = [
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>',
        answer.format(**fill),
    ]
    eng = RolloutEngine(*build_registries(ScriptedClient(replies)))
    req = RolloutRequest(
        env=EnvSpec("arithmetic", {"digits": 3, "ops": ["*"]}),
        env_seed=7,
        protocol=ProtocolSpec(agent=AgentSpec("tool", {"tools": ["calculator"]})),
        reward=RewardSpec(functions=(RewardFnSpec("tool_result", weight=0.5),)),
    )
    (ro,) = await eng.generate_rollouts([req], max_steps=2)
    assert [s.info.get("kind") for s in ro.steps] == ["tool_call", "action"]
    assert [s.reward for s in ro.steps] == pytest.approx(want)


async def test_tool_result_without_a_reference_answer_names_the_key():
    spec = RewardSpec(functions=(RewardFnSpec("tool_result", {"answer_key": "solution"}),))
    with pytest.raises(RewardError, match=r"info\['solution'\]"):
        await run(spec, ["3", "2", "1"])
