"""The ``verifiers`` env kind: verifiers 0.4.0 environments through the real rollout engine.

verifiers pins mcp==2.0.0 and openai<3; the project venv holds vLLM's mcp 2.3 and openai 3, so
these tests run in a side venv that sees the project's packages and adds verifiers:

    bash scripts/adapter-venvs.sh verifiers  # runs/venvs/verifiers, idempotent
    runs/venvs/verifiers/bin/python -m pytest tests/adapters/test_verifiers_env.py

Elsewhere they skip. The environments (vf_sums.py, vf_guess.py beside this file) are
written with verifiers' own API the way an environment package is, and are played by a
ScriptedClient: its token ids and logprobs are what each step records.
"""

from __future__ import annotations

from pathlib import Path

import pytest

vf = pytest.importorskip(
    "verifiers.v1",
    reason="verifiers 0.4.0 lives in a side venv: bash scripts/adapter-venvs.sh, then run "
    "this file with runs/venvs/verifiers/bin/python -m pytest",
)

from libludic import plugins  # noqa: E402
from libludic.envs.verifiers_env import VerifiersEnv  # noqa: E402
from libludic.registry import build_registries  # noqa: E402
from libludic.requests import EnvSpec, RolloutRequest  # noqa: E402
from libludic.rollout.engine import RolloutEngine  # noqa: E402
from tests.fakes import ScriptedClient  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def taskset_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    # a verifiers id is a top-level module name: vf_sums, vf_guess
    monkeypatch.syspath_prepend(str(HERE))


def add(request) -> str:
    """The right sum for "What is a + b?"."""
    a, b = request.messages[-1]["content"].removeprefix("What is ").rstrip("?").split(" + ")
    return str(int(a) + int(b))


def test_the_kind_is_registered():
    assert plugins.resolve("envs", "verifiers") is VerifiersEnv


async def test_single_turn_taskset_scores_with_its_rewards():
    client = ScriptedClient([add, "seven", add])
    engine = RolloutEngine(*build_registries(client))
    spec = EnvSpec("verifiers", {"taskset": "vf_sums", "taskset_args": {"n": 4}})
    req = RolloutRequest(env=spec, env_seed=1, sampling_seed=0, num_episodes=3)
    rollouts = await engine.generate_rollouts([req], max_steps=4, concurrency=3)
    # seeds 1, 2, 3 -> tasks 1, 2, 3 (1+2, 2+4, 3+6); replies "3", "seven", "9".
    # r = 1.0 * correct + 0.5 * short (short = 0.5 when the reply has <= 3 characters):
    # "3": 1.0 + 0.25 = 1.25; "seven": 0 + 0 = 0; "9": 1.25
    assert [r.total_reward for r in rollouts] == [1.25, 0.0, 1.25]
    assert all(len(r.steps) == 1 and r.steps[0].terminated for r in rollouts)
    first = rollouts[0].steps[0]
    assert first.prev_obs == "What is 1 + 2?" and first.action == "3"
    assert first.info["vf_rewards"] == {"correct": 1.0, "short": 0.5}
    assert first.info["vf_weights"] == {"correct": 1.0, "short": 0.5}
    assert first.info["vf_metrics"] == {"reply_chars": 1.0}
    assert first.info["vf_stop"] == ["agent_completed"]
    # the task's system prompt reached the model; the step keeps the sampled tokens
    assert client.requests[0].messages[0] == {
        "role": "system",
        "content": "Answer with the number only.",
    }
    assert first.trace is not None
    assert first.trace.completion_token_ids == [*b"3", 258]
    assert first.trace.completion_logprobs == [-0.5, -0.5]


async def test_multi_turn_env_plays_turn_by_turn():
    client = ScriptedClient(["3", "6", "5"])
    engine = RolloutEngine(*build_registries(client))
    req = RolloutRequest(env=EnvSpec("verifiers", {"taskset": "vf_guess"}), env_seed=0)
    (rollout,) = await engine.generate_rollouts([req], max_steps=10)
    # secret 5: 3 -> "higher", 6 -> "lower", 5 -> solved on guess 3:
    # solved = 1 - 0.25 * (3 - 1) = 0.5; polite (weight 0.1) = 1 -> r = 0.5 + 0.1 = 0.6
    assert [s.action for s in rollout.steps] == ["3", "6", "5"]
    assert [s.next_obs for s in rollout.steps] == ["higher", "lower", ""]
    assert [s.reward for s in rollout.steps] == [0.0, 0.0, pytest.approx(0.6)]
    assert rollout.steps[-1].terminated and not rollout.steps[-1].truncated
    assert rollout.steps[-1].info["vf_rewards"] == {"polite": 1.0, "solved": 0.5}
    # the env's user turns are the model's next user messages
    assert [m["content"] for m in client.requests[2].messages if m["role"] == "user"] == [
        "Guess my number in 1..8. Reply with the number only.",
        "higher",
        "lower",
    ]


async def test_env_ending_the_game_scores_a_loss():
    engine = RolloutEngine(*build_registries(ScriptedClient(["1"])))
    req = RolloutRequest(env=EnvSpec("verifiers", {"taskset": "vf_guess"}), env_seed=1)
    (rollout,) = await engine.generate_rollouts([req], max_steps=10)
    # secret 2, four guesses of 1 (max_guesses=4): solved 0, polite 1 -> r = 0.1
    assert len(rollout.steps) == 4
    assert rollout.total_reward == pytest.approx(0.1)


async def test_max_steps_truncates_and_cancels_the_run():
    engine = RolloutEngine(*build_registries(ScriptedClient(["1"])))
    req = RolloutRequest(env=EnvSpec("verifiers", {"taskset": "vf_guess"}), env_seed=2)
    (rollout,) = await engine.generate_rollouts([req], max_steps=2)
    assert len(rollout.steps) == 2 and rollout.total_reward == 0.0
    assert rollout.steps[-1].truncated
    assert rollout.steps[-1].info["truncation_reason"] == "max_steps"


async def test_the_boxed_sums_example_scores_with_math_verify(monkeypatch):
    # examples/verifiers: verifiers' verify_boxed_math_answer times out with signals, so it
    # scores only where the env runs in the main thread (a worker thread gets 0.0)
    monkeypatch.syspath_prepend(str(HERE.parents[1] / "examples" / "verifiers"))
    client = ScriptedClient(["The sum is \\boxed{5}.", "5"])
    engine = RolloutEngine(*build_registries(client))
    spec = EnvSpec("verifiers", {"taskset": "vf_boxed_sums", "taskset_args": {"split": "eval"}})
    req = RolloutRequest(env=spec, env_seed=4, same_env_seed=True, num_episodes=2)
    rollouts = await engine.generate_rollouts([req], max_steps=1, concurrency=1)
    # the eval split is every 8th of the 100 tasks: seed 4 is task 32, 3 + 2. The boxed
    # answer scores 1; the bare "5" has no box for math-verify to read: 0
    assert rollouts[0].steps[0].prev_obs == "What is 3 + 2?"
    assert [r.total_reward for r in rollouts] == [1.0, 0.0]


def test_max_turns_of_the_seat_stops_the_exchange():
    env = VerifiersEnv("vf_guess", env_args={"player": {"max_turns": 2}})
    obs, _ = env.reset(seed=0)["agent"]
    assert env.step({"agent": "1"})["agent"].obs == "higher"
    out = env.step({"agent": "2"})["agent"]
    # the stop ends the exchange before a third guess: solved 0, polite 0.1
    assert out.terminated and out.reward == pytest.approx(0.1)
    assert out.info["vf_stop"] == ["max_turns"]


def test_a_seat_no_model_plays_is_refused_by_name():
    with pytest.raises(ValueError, match=r"has seats \['assistant', 'user'\]; choose one"):
        VerifiersEnv("vf_guess", env_id="user-sim")
    env = VerifiersEnv("vf_guess", env_id="user-sim", role="assistant")
    env.reset(seed=0)
    with pytest.raises(RuntimeError, match="asked seat 'user' to interaction"):
        env.step({"agent": "hello"})


def test_an_unknown_taskset_names_the_fix():
    with pytest.raises(ValueError, match="taskset 'no_such_tasks' not found"):
        VerifiersEnv("no_such_tasks")


def test_a_bad_taskset_field_names_it():
    with pytest.raises(ValueError, match="n_rows"):
        VerifiersEnv("vf_sums", {"n_rows": 3})


def test_the_example_config_builds(monkeypatch):
    # examples/verifiers/grpo.yaml, checked as `ludic check` and the services do
    import yaml

    from libludic.tasks import check_task, parse_tasks

    root = HERE.parents[1]
    monkeypatch.syspath_prepend(str(root / "examples" / "verifiers"))
    cfg = yaml.safe_load((root / "examples" / "verifiers" / "grpo.yaml").read_text())
    for i, task in enumerate(parse_tasks(cfg["feeder"]["tasks"], "feeder.tasks")):
        check_task(task, f"feeder.tasks[{i}]")
