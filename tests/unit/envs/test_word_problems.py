"""The word_problems env kind: generated GSM8K-style problems whose answers are worked out
here from their text, episodes through the rollout engine, the held-out split, number
reading and the errors of a bad config."""

from __future__ import annotations

import re

import pytest

from libludic.envs.word_problems import (
    TEMPLATES,
    WordProblemEnv,
    generate_problem,
    in_eval_split,
    read_number,
)
from libludic.registry import build_registries
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from tests.fakes import ScriptedClient

LAST_INTEGER = {"kind": "regex", "pattern": r"(-?\d+)\D*$"}

# each template's story, read back into its answer (independently of the generator)
SOLVERS = [
    (r"has (\d+) \w+\. \w+ buys (\d+) more \w+\. How many", lambda a, b: a + b),
    (r"has (\d+) \w+ and gives (\d+) of them", lambda a, b: a - b),
    (r"has (\d+) \w+ with (\d+) \w+ in each\. How many", lambda a, b: a * b),
    (r"shares (\d+) \w+ equally among (\d+) friends", lambda a, b: a // b),
    (r"has (\d+) \w+\. \w+ has (\d+) more \w+ than", lambda a, b: a + a + b),
    (r"has (\d+) \w+\. \w+ buys (\d+) more and then gives (\d+)", lambda a, b, c: a + b - c),
    (r"buys (\d+) \w+ of \w+ with (\d+) \w+ in each\. \w+ uses (\d+)", lambda a, b, c: a * b - c),
    (
        r"earns (\d+) dollars a day and works for (\d+) days, then spends (\d+)",
        lambda a, b, c: a * b - c,
    ),
    (r"has (\d+) \w+\. \w+ has (\d+) times as many", lambda a, b: a + a * b),
]


def solve(question: str) -> int:
    hits = [(p, f) for p, f in SOLVERS if re.search(p, question)]
    assert len(hits) == 1, question
    pattern, f = hits[0]
    return f(*map(int, re.search(pattern, question).groups()))


def test_every_template_states_a_problem_whose_answer_follows_from_its_text():
    seen = set()
    for steps in (1, 2):
        for seed in range(400):
            p = generate_problem(seed, (steps,), max_number=20)
            assert p.steps == steps and p.answer == solve(p.question) and p.answer >= 0
            assert all(int(n) <= 20 * 10 for n in re.findall(r"\d+", p.question))
            seen.add(next(pat for pat, _ in SOLVERS if re.search(pat, p.question)))
    assert len(seen) == sum(len(t) for t in TEMPLATES.values()) == len(SOLVERS)


def test_a_seed_names_one_problem_and_the_split_holds_out_a_tenth():
    assert generate_problem(7, (1, 2)) == generate_problem(7, (1, 2))
    train = {generate_problem(s, (1,), split="train").question for s in range(600)}
    held = {generate_problem(s, (1,), split="eval").question for s in range(600)}
    assert train.isdisjoint(held) and len(held) > 300  # many distinct held-out problems
    assert all(in_eval_split(q) for q in held) and not any(in_eval_split(q) for q in train)
    every = [generate_problem(s, (1,)).question for s in range(2000)]
    assert 0.06 < sum(map(in_eval_split, every)) / len(every) < 0.14


@pytest.mark.parametrize(
    ("text", "value"),
    [("12", 12.0), ("12.0", 12.0), ("1,200", 1200.0), ("$12", 12.0), ("-3", -3.0), ("12.", 12.0)],
)
def test_answers_read_as_numbers(text, value):
    assert read_number(text) == value


@pytest.mark.parametrize("text", ["", "twelve", "12 apples", "1.2.3"])
def test_what_is_not_a_number_reads_as_none(text):
    assert read_number(text) is None


async def run(reply, seed=3):
    eng = RolloutEngine(*build_registries(ScriptedClient([reply])))
    req = RolloutRequest(
        env=EnvSpec(
            "word_problems",
            {"steps": [1, 2], "split": "eval", "prompt_template": "{question}\nJust the number."},
        ),
        protocol=ProtocolSpec("single_agent", {"parser": LAST_INTEGER}),
        env_seed=seed,
    )
    (rollout,) = await eng.generate_rollouts([req], max_steps=1)
    return rollout


def question_of(request) -> str:
    text = request.messages[-1]["content"]
    assert text.endswith("\nJust the number.")
    return text.removesuffix("\nJust the number.")


async def test_a_right_answer_in_a_sentence_scores_one_through_the_engine():
    r = await run(lambda req: f"So the answer is {solve(question_of(req))} in all.")
    (step,) = r.steps
    assert r.total_reward == 1.0 and step.info["correct"] is True
    assert step.info["answer"] == str(solve(step.prev_obs.removesuffix("\nJust the number.")))


async def test_a_wrong_answer_scores_zero():
    r = await run(lambda req: f"It is {solve(question_of(req)) + 1}.", seed=4)
    assert r.total_reward == 0.0 and r.steps[0].info["correct"] is False


def test_reference_completion_and_score_completion():
    env = WordProblemEnv(steps=(2,), split="eval")
    obs, info = env.env_reset(seed=11)
    ref = env.reference_completion()
    assert ref == info["answer"] == str(solve(obs)) and info["steps"] == 2
    assert env.score_completion(ref, ref) == 1.0
    assert env.score_completion(f"{ref}.0", ref) == 1.0
    assert env.score_completion(str(int(ref) + 1), ref) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": [3]}, r"steps=\[3\]: each must be one of \[1, 2\]"),
        ({"steps": []}, r"steps=\[\]"),
        ({"max_number": 2}, "max_number=2 must be >= 3"),
        ({"split": "test"}, "split='test' must be None, 'train' or 'eval'"),
        ({"prompt_template": "Solve it."}, r"lacks \{question\}"),
    ],
)
def test_a_bad_config_is_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WordProblemEnv(**kwargs)
