"""The reasoning_gym env kind on the real reasoning-gym package: episodes through the rollout
engine scored by the dataset's own score_answer, the held-out split, the task check and the
errors of a bad config."""

from __future__ import annotations

import re

import pytest

from libludic.envs import reasoning_gym as rg_env
from libludic.envs.reasoning_gym import ReasoningGymEnv, in_eval_split
from libludic.plugins import PluginError
from libludic.registry import build_registries
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from libludic.tasks import TaskSpec, check_task
from tests.fakes import ScriptedClient

# one-digit sums of 2 terms: 10 x 10 operands x 2 operators = 200 distinct problems, so 2000
# entries repeat each ~10 times (a split by index or seed would put copies on both sides)
SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
ENV = {"dataset": "chain_sum", "config": SUMS, "size": 2000}
LAST_INTEGER = {"kind": "regex", "pattern": r"(-?\d+)\D*$"}
QUESTION = re.compile(r"problem: (\d) ([+-]) (\d) =$")


def solve(question: str) -> int:
    """The sum a chain_sum question asks, worked out from its text (not from the env)."""
    m = QUESTION.search(question)
    assert m is not None, question
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b


def padded(x: int) -> str:
    """``x`` with its sign, a leading zero and a decimal point: ``7`` -> ``"+07.0"``."""
    return f"{'-' if x < 0 else '+'}0{abs(x)}.0"


def last_user_text(request) -> str:
    return request.messages[-1]["content"]


async def run(reply, parser=LAST_INTEGER, seed=3, **env):
    eng = RolloutEngine(*build_registries(ScriptedClient([reply])))
    req = RolloutRequest(
        env=EnvSpec("reasoning_gym", {**ENV, "split": "train", **env}),
        protocol=ProtocolSpec("single_agent", {"parser": parser}),
        env_seed=seed,
    )
    (rollout,) = await eng.generate_rollouts([req], max_steps=1)
    return rollout


async def test_a_right_answer_scores_one_through_the_engine():
    r = await run(lambda req: f"I think it is {solve(last_user_text(req))}.")
    (step,) = r.steps
    assert r.total_reward == 1.0 and step.info["correct"] is True
    assert step.info["reference"] == str(solve(step.prev_obs))
    assert step.info["dataset"] == "chain_sum"


async def test_a_wrong_answer_scores_what_the_dataset_says():
    r = await run(lambda req: f"It is {solve(last_user_text(req)) + 1}.")
    assert r.total_reward == 0.0 and r.steps[0].info["correct"] is False
    # the dataset's score, not an exact match: chain_sum compares decimals ("+07.0" == "7")
    # and, failing that, gives len(reference) / len(reply) when the reply contains it
    r = await run(lambda req: padded(solve(last_user_text(req))), parser=None)
    assert r.total_reward == 1.0 and r.steps[0].action != r.steps[0].info["reference"]
    r = await run(lambda req: f"= {solve(last_user_text(req))}", parser=None, seed=4)
    ref = r.steps[0].info["reference"]
    assert r.total_reward == pytest.approx(len(ref) / (len(ref) + 2))  # "= 7": 1/3


def test_env_seed_selects_the_splits_problem_and_the_prompt_template():
    env = ReasoningGymEnv(**ENV, split="train", prompt_template="Q: {question} Put it in \\boxed{}")
    n = len(env)
    obs, info = env.env_reset(seed=5)
    again, info_again = env.env_reset(seed=5 + n)  # problem seed % n of the split's n
    assert again == obs and info_again["index"] == info["index"] == env.indices[5]
    question = env.source.entry(info["index"])["question"]
    assert obs == f"Q: {question} Put it in \\boxed{{}}"
    assert info["reference"] == str(solve(question)) == env.reference_completion()


def test_the_held_out_split_shares_no_problem_with_train():
    train = ReasoningGymEnv(**ENV, split="train")
    held = ReasoningGymEnv(**ENV, split="eval")
    every = ReasoningGymEnv(**ENV)

    def questions(env: ReasoningGymEnv) -> set[str]:
        return {env.env_reset(seed=s)[0] for s in range(len(env))}

    q_train, q_eval, q_all = questions(train), questions(held), questions(every)
    assert len(train) + len(held) == len(every) == 2000
    assert q_train.isdisjoint(q_eval) and q_train | q_eval == q_all
    # all 200 problems appear; a tenth of them (by hash of the question) are held out
    assert len(q_all) == 200 and 10 <= len(q_eval) <= 35
    assert all(in_eval_split(q) for q in q_eval) and not any(in_eval_split(q) for q in q_train)
    # another dataset seed and size draws other entries, and the split still holds
    other = ReasoningGymEnv(**{**ENV, "size": 500}, dataset_seed=7, split="train")
    assert questions(other).isdisjoint(q_eval)


def test_datasets_are_built_once_per_process():
    a = ReasoningGymEnv(**ENV, split="eval")
    b = ReasoningGymEnv(**ENV, split="train")
    assert a.source is b.source
    assert ReasoningGymEnv(**ENV, dataset_seed=1).source is not a.source


def test_score_completion_scores_against_the_problem_of_the_reference():
    env = ReasoningGymEnv(**ENV, split="eval")
    problems = []
    for s in range(5):  # as supervised checks do: reset every problem, then score them all
        obs, _ = env.env_reset(seed=s)
        problems.append((obs, env.reference_completion()))
    for obs, ref in problems:
        assert ref == str(solve(obs))
        assert env.score_completion(ref, ref) == 1.0
        assert env.score_completion(str(int(ref) + 1), ref) == 0.0
        assert env.score_completion(f"= {ref}", ref) == pytest.approx(len(ref) / (len(ref) + 2))


def test_a_dataset_without_an_answer_states_no_reference():
    env = ReasoningGymEnv("boxnet", size=5)  # its score_answer checks a plan against the grid
    _, info = env.env_reset(seed=0)
    assert info["reference"] is None
    with pytest.raises(ValueError, match="'boxnet' states no answer for entry 0"):
        env.reference_completion()


def task(**env_kwargs) -> TaskSpec:
    return TaskSpec.from_dict(
        {
            "name": "sums",
            "env": {"kind": "reasoning_gym", "kwargs": {**ENV, **env_kwargs}},
            "protocol": {"kind": "single_agent", "kwargs": {"parser": LAST_INTEGER}},
            "inference": {"sampling": {"temperature": 1.0, "max_tokens": 16}},
        },
        "feeder.tasks[0]",
    )


def test_check_task_builds_a_reasoning_gym_task():
    assert check_task(task(split="train"), "feeder.tasks[0]") < 10.0


@pytest.mark.parametrize(
    "env_kwargs, match",
    [
        (
            {"dataset": "chain_summ"},
            r"dataset='chain_summ' is not a reasoning-gym dataset \(did you mean 'chain_sum'.*"
            r"the 106 datasets: .*basic_arithmetic, .*word_sorting",
        ),
        (
            {"config": {"min_term": 2}},
            r"'chain_sum': unknown config field\(s\) \['min_term'\]; its fields: \['min_terms'",
        ),
        ({"config": {"min_terms": 3, "max_terms": 2}}, r"rejected config .*max_terms must be >="),
        (
            {"config": {"seed": 3}},
            r"config sets \['seed'\]; give the env's size= and dataset_seed=",
        ),
        ({"split": "test"}, r"split='test' must be null, 'train' or 'eval'"),
        ({"prompt_template": "Solve it"}, r"must contain '\{question\}'"),
    ],
)
def test_a_bad_config_names_the_value_and_the_choices(env_kwargs, match):
    with pytest.raises(PluginError, match=r"feeder\.tasks\[0\] \(sums\)\.env \(reasoning_gym\)"):
        check_task(task(**env_kwargs), "feeder.tasks[0]")
    with pytest.raises(ValueError, match=match):
        ReasoningGymEnv(**{**ENV, **env_kwargs})


def test_an_empty_split_is_refused():
    # 3 entries: the chance that one of them is held out is small; find a seed with none
    seed = next(
        s
        for s in range(100)
        if not any(
            in_eval_split(q["question"])
            for q in rg_env.dataset_source("chain_sum", SUMS, 3, s).dataset
        )
    )
    with pytest.raises(ValueError, match="holds no eval problems among its 3 entries"):
        ReasoningGymEnv(**{**ENV, "size": 3}, dataset_seed=seed, split="eval")


def test_distinct_keeps_each_question_once_in_dataset_order():
    # one-digit products: 100 problems among 400 entries, so questions repeat
    kw = {
        "dataset": "products",
        "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "size": 400,
    }
    every = ReasoningGymEnv(**kw, split="eval")
    once = ReasoningGymEnv(**kw, split="eval", distinct=True)
    questions = [every.source.entry(i)["question"] for i in every.indices or []]
    assert len(set(questions)) < len(questions)  # repeats among the eval entries
    kept = [once.source.entry(i)["question"] for i in once.indices or []]
    assert kept == list(dict.fromkeys(questions))  # each once, at its first entry
    assert len(once) == len(kept)
    # over the whole dataset too (split null), and the flag is checked
    assert len(ReasoningGymEnv(**kw, distinct=True)) == len(
        {e["question"] for e in every.source.dataset}
    )
    with pytest.raises(ValueError, match="distinct='yes' must be true or false"):
        ReasoningGymEnv(**kw, distinct="yes")  # type: ignore[arg-type]
