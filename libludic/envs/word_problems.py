"""WordProblemEnv: GSM8K-style math word problems, generated with numeric answers.

GSM8K itself cannot be downloaded on a machine without network access (examples/gsm8k reads
a 20-problem sample); this env generates problems of its kind locally: a short story about
people and things, one question, an integer answer. Each problem is a template (below) with
a name, a kind of item and numbers drawn from a seeded generator, so a seed names a problem
exactly. ``steps`` chooses the templates by how many operations their answer takes (1: one
of +, -, x or /; 2: two of them, as most of GSM8K's easiest problems); ``max_number`` bounds
the numbers in the story.

Episode: ``reset(seed)`` shows the problem through ``prompt_template`` (``{question}`` is
replaced by the story and its question, every other character kept); ``step(answer)`` ends
the episode with reward 1.0 when ``answer`` is the integer answer (``"12"``, ``"12.0"``,
``"1,200"`` and ``"$12"`` all read as numbers) and 0.0 otherwise. ``answer`` is what the
protocol's parser extracted from the reply: a chat model answers in sentences, so give the
protocol a parser that takes the number (``{kind: regex, pattern: '(-?\\d+)\\D*$'}``, the
last integer of the reply, or ``boxed``).

Held-out split: a problem is an *eval* problem when a hash of its question text falls in the
first tenth of the hash range; ``split="train"`` never yields one, ``split="eval"`` only
those, ``split=None`` anything (libludic/envs/splits.py, shared with arithmetic and
reasoning_gym).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.envs.splits import SPLITS, in_eval_split
from libludic.types import Info, Obs, StepOutcome

NAMES = (
    "Tom", "Anna", "Ben", "Maria", "Sam", "Lily", "Jack", "Emma", "Leo", "Mia",
    "Noah", "Sara", "Omar", "Grace", "Ravi", "Chloe",
)  # fmt: skip
ITEMS = (
    "apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells",
    "cards", "flowers", "eggs", "coins",
)  # fmt: skip
CONTAINERS = ("bags", "boxes", "baskets", "jars", "packs", "trays")


@dataclass(frozen=True)
class WordProblem:
    question: str
    answer: int
    steps: int


# A template draws its numbers from (rng, max_number) and returns (question, answer), or None
# to draw again (a difference below zero, a division with a remainder).
Template = Callable[[random.Random, int, str, str, str], "tuple[str, int] | None"]


def _n(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, max(lo, hi))


def _buy(rng: random.Random, m: int, name: str, friend: str, item: str) -> tuple[str, int]:
    a, b = _n(rng, 2, m), _n(rng, 2, m)
    return (
        f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?",
        a + b,
    )


def _give(rng: random.Random, m: int, name: str, friend: str, item: str) -> tuple[str, int] | None:
    a, b = _n(rng, 2, m), _n(rng, 1, m)
    if b >= a:
        return None
    return (
        f"{name} has {a} {item} and gives {b} of them to {friend}. How many {item} does {name} have left?",
        a - b,
    )


def _groups(rng: random.Random, m: int, name: str, friend: str, item: str) -> tuple[str, int]:
    a, b = _n(rng, 2, min(m, 12)), _n(rng, 2, min(m, 12))
    box = rng.choice(CONTAINERS)
    return f"{name} has {a} {box} with {b} {item} in each. How many {item} does {name} have?", a * b


def _share(rng: random.Random, m: int, name: str, friend: str, item: str) -> tuple[str, int]:
    k, each = _n(rng, 2, min(m, 10)), _n(rng, 2, min(m, 12))
    return (
        f"{name} shares {k * each} {item} equally among {k} friends. How many {item} does each friend get?",
        each,
    )


def _more_than(rng: random.Random, m: int, name: str, friend: str, item: str) -> tuple[str, int]:
    a, b = _n(rng, 2, m), _n(rng, 1, m)
    return (
        f"{name} has {a} {item}. {friend} has {b} more {item} than {name}. "
        f"How many {item} do {name} and {friend} have together?",
        a + (a + b),
    )


def _buy_then_give(
    rng: random.Random, m: int, name: str, friend: str, item: str
) -> tuple[str, int] | None:
    a, b, c = _n(rng, 2, m), _n(rng, 2, m), _n(rng, 1, m)
    if c >= a + b:
        return None
    return (
        f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to {friend}. "
        f"How many {item} does {name} have now?",
        a + b - c,
    )


def _groups_minus(
    rng: random.Random, m: int, name: str, friend: str, item: str
) -> tuple[str, int] | None:
    a, b, c = _n(rng, 2, min(m, 10)), _n(rng, 2, min(m, 10)), _n(rng, 1, m)
    if c >= a * b:
        return None
    box = rng.choice(CONTAINERS)
    return (
        f"{name} buys {a} {box} of {item} with {b} {item} in each. "
        f"{name} uses {c} of them. How many {item} are left?",
        a * b - c,
    )


def _wage(rng: random.Random, m: int, name: str, friend: str, item: str) -> tuple[str, int] | None:
    a, b, c = _n(rng, 2, min(m, 12)), _n(rng, 2, min(m, 10)), _n(rng, 1, m)
    if c >= a * b:
        return None
    return (
        f"{name} earns {a} dollars a day and works for {b} days, then spends {c} dollars. "
        f"How many dollars does {name} have left?",
        a * b - c,
    )


def _two_friends(rng: random.Random, m: int, name: str, friend: str, item: str) -> tuple[str, int]:
    a, b = _n(rng, 2, min(m, 12)), _n(rng, 2, min(m, 10))
    return (
        f"{name} has {a} {item}. {friend} has {b} times as many {item} as {name}. "
        f"How many {item} do they have together?",
        a + a * b,
    )


TEMPLATES: dict[int, tuple[Template, ...]] = {
    1: (_buy, _give, _groups, _share),
    2: (_more_than, _buy_then_give, _groups_minus, _wage, _two_friends),
}


def generate_problem(
    seed: int, steps: Sequence[int] = (1,), max_number: int = 20, split: str | None = None
) -> WordProblem:
    """The problem named by ``seed`` (deterministic across processes and machines)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be None, 'train' or 'eval'")
    if not steps or any(s not in TEMPLATES for s in steps):
        raise ValueError(f"steps={list(steps)!r}: each must be one of {sorted(TEMPLATES)}")
    if max_number < 3:
        raise ValueError(f"max_number={max_number} must be >= 3")
    rng = random.Random(seed)
    while True:  # rejection sampling keeps the draw a pure function of the seed
        n_steps = steps[rng.randrange(len(steps))]
        template = TEMPLATES[n_steps][rng.randrange(len(TEMPLATES[n_steps]))]
        name, friend = rng.sample(NAMES, 2)
        drawn = template(rng, max_number, name, friend, rng.choice(ITEMS))
        if drawn is None:
            continue
        question, answer = drawn
        if split is None or in_eval_split(question) == (split == "eval"):
            return WordProblem(question=question, answer=answer, steps=n_steps)


_NUMBER = re.compile(r"^\$?(-?[\d,]*\.?\d+)$")


def read_number(text: str) -> float | None:
    """``text`` as a number (``"12"``, ``"12.0"``, ``"1,200"``, ``"$12"``), or None."""
    m = _NUMBER.match(text.strip().rstrip("."))
    if m is None:
        return None
    try:
        return float(m.group(1).replace(",", ""))
    except ValueError:
        return None


def score_answer(answer: str, target: int) -> float:
    got = read_number(answer)
    return 1.0 if got is not None and got == target else 0.0


def check_template(prompt_template: str) -> None:
    if "{question}" not in prompt_template:
        raise ValueError(
            f"WordProblemEnv prompt_template {prompt_template!r} lacks {{question}}: the model "
            "could not tell which problem it is asked"
        )


class WordProblemEnv(SingleAgentEnv):
    """One-step episodes: observe a word problem, answer with a number, get the reward."""

    def __init__(
        self,
        steps: Sequence[int] = (1,),
        max_number: int = 20,
        split: str | None = None,
        prompt_template: str = "{question}",
        system_prompt: str | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"WordProblemEnv split={split!r} must be None, 'train' or 'eval'")
        check_template(prompt_template)
        generate_problem(0, steps, max_number, None)  # refuses bad steps/max_number now
        self.steps = tuple(steps)
        self.max_number = max_number
        self.split = split
        self.prompt_template = prompt_template
        self._system_prompt = system_prompt
        self.problem: WordProblem | None = None

    @property
    def suggested_system_prompt(self) -> str | None:
        return self._system_prompt

    def _render(self) -> str:
        if self.problem is None:
            raise RuntimeError("WordProblemEnv has no problem before env_reset")
        return self.prompt_template.replace("{question}", self.problem.question)

    def env_reset(self, *, seed: int | None = None) -> tuple[Obs, Info]:
        s = random.randrange(2**31) if seed is None else seed
        self.problem = generate_problem(s, self.steps, self.max_number, self.split)
        info: Info = {"seed": s, "answer": str(self.problem.answer), "steps": self.problem.steps}
        return self._render(), info

    def env_step(self, action: str) -> StepOutcome:
        if self.problem is None:
            raise RuntimeError("WordProblemEnv.env_step called before env_reset")
        reward = score_answer(action, self.problem.answer)
        return StepOutcome(
            obs="correct" if reward == 1.0 else f"wrong, the answer was {self.problem.answer}",
            reward=reward,
            terminated=True,
            info={"answer": str(self.problem.answer), "correct": reward == 1.0},
        )

    def env_current_obs(self) -> Obs:
        return self._render()

    # ReferenceEnv (libludic/envs/reference.py): supervised data and checks from this env

    def reference_completion(self) -> str:
        if self.problem is None:
            raise RuntimeError("WordProblemEnv has no problem before env_reset")
        return str(self.problem.answer)

    def score_completion(self, completion: str, reference: str) -> float:
        return score_answer(completion, int(reference))


__all__ = ["WordProblem", "WordProblemEnv", "generate_problem", "read_number", "score_answer"]
