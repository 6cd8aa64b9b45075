"""Synthetic arithmetic task: the demo's environment.

A problem is ``"a+b="`` (or ``-``, ``*``) with operands of ``digits`` digits drawn from a
seeded generator, so a seed names a problem exactly. Two-digit addition has only 8,100
distinct problems, so seeds alone cannot hold anything out: ``split`` partitions the
problem space itself. A problem is an *eval* problem when a hash of its operands falls in
the first tenth of the hash range (a pseudo-random 10% of all problems, unrelated to their
digits, so the held-out set has the training distribution); ``split="train"`` never
yields one, ``split="eval"`` only yields them, ``split=None`` yields anything. The agent answers with the result;
reward is 1.0 for an exact match of the stripped answer and 0.0 otherwise. With
``partial_credit=True`` a wrong answer of the right length earns
``matching_digits / len(answer)`` (scaled by ``partial_scale``), which gives a denser
signal to a weak policy.

The observation is the bare ``"a+b="`` (what the demo's tiny model is trained on) unless
``prompt`` is a template: ``{a}``, ``{op}`` and ``{b}`` are replaced by the problem's
operands and operator and every other character is kept, so a chat model can be told how
to answer, e.g. ``"What is {a} + {b}? Answer with just the number."``. A chat model answers
in sentences: give the protocol a parser that extracts the number (such as
``{kind: regex, pattern: '(-?\\d+)\\D*$'}``, the last integer of the reply) and the env
scores what it extracted.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libludic.envs import splits
from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.envs.splits import SPLITS
from libludic.types import Info, Obs, StepOutcome


@dataclass(frozen=True)
class ArithmeticProblem:
    a: int
    op: str  # "+", "-" or "*"
    b: int
    answer: str  # e.g. "46"

    @property
    def question(self) -> str:
        """The bare form, e.g. ``"12+34="``."""
        return f"{self.a}{self.op}{self.b}="


def in_eval_split(a: int, b: int) -> bool:
    """The operands' held-out bucket (libludic/envs/splits.py)."""
    return splits.in_eval_split(f"{a},{b}")


def generate_problem(
    seed: int, digits: int = 2, ops: Sequence[str] = ("+",), split: str | None = None
) -> ArithmeticProblem:
    """The problem named by ``seed`` (deterministic across processes and machines)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be None, 'train' or 'eval'")
    if digits < 1:
        raise ValueError(f"digits={digits} must be >= 1")
    for op in ops:
        if op not in ("+", "-", "*"):
            raise ValueError(f"unsupported op {op!r}; use '+', '-' or '*'")
    rng = random.Random(seed)
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    hi = 10**digits - 1
    while True:  # rejection sampling keeps the draw a pure function of the seed
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if split is None or in_eval_split(a, b) == (split == "eval"):
            break
    op = ops[rng.randrange(len(ops))]
    if op == "-" and b > a:
        a, b = b, a
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return ArithmeticProblem(a=a, op=op, b=b, answer=str(value))


PROMPT_FIELDS = ("a", "op", "b")
_FIELD = re.compile(r"\{(a|op|b)\}")
_NAMED = re.compile(r"\{([A-Za-z_]\w*)\}")


def check_prompt(prompt: str, ops: Sequence[str]) -> None:
    """Refuse a template that cannot state every problem: one without ``{a}`` or ``{b}``,
    without ``{op}`` when ``ops`` has several, or naming a field that does not exist."""
    unknown = sorted(set(_NAMED.findall(prompt)) - set(PROMPT_FIELDS))
    if unknown:
        raise ValueError(
            f"ArithmeticEnv prompt {prompt!r} names unknown field(s) {unknown}; the fields "
            "are {a}, {op} and {b}"
        )
    need = ["a", "b"] + (["op"] if len(set(ops)) > 1 else [])
    missing = [f"{{{f}}}" for f in need if f"{{{f}}}" not in prompt]
    if missing:
        raise ValueError(
            f"ArithmeticEnv prompt {prompt!r} lacks {', '.join(missing)}: the model could not "
            "tell which problem it is asked"
        )


def render_prompt(prompt: str | None, problem: ArithmeticProblem) -> str:
    """``problem`` as the model sees it: the bare question, or ``prompt`` filled in."""
    if prompt is None:
        return problem.question
    return _FIELD.sub(lambda m: str(getattr(problem, m.group(1))), prompt)


def score_answer(
    answer: str, target: str, partial_credit: bool = False, partial_scale: float = 0.5
) -> float:
    got = answer.strip()
    if got == target:
        return 1.0
    if not partial_credit or len(got) != len(target):
        return 0.0
    same = sum(1 for x, y in zip(got, target) if x == y)
    return partial_scale * same / len(target)


class ArithmeticEnv(SingleAgentEnv):
    """One-step episodes: observe ``"a+b="`` (or ``prompt`` filled in), answer, get the
    reward, done."""

    def __init__(
        self,
        digits: int = 2,
        ops: Sequence[str] = ("+",),
        partial_credit: bool = False,
        partial_scale: float = 0.5,
        system_prompt: str | None = None,
        split: str | None = None,
        prompt: str | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"ArithmeticEnv split={split!r} must be None, 'train' or 'eval'")
        if prompt is not None:
            check_prompt(prompt, ops)
        self.prompt = prompt
        self.split = split
        self.digits = digits
        self.ops = tuple(ops)
        self.partial_credit = partial_credit
        self.partial_scale = partial_scale
        self._system_prompt = system_prompt
        self.problem: ArithmeticProblem | None = None

    @property
    def suggested_system_prompt(self) -> str | None:
        return self._system_prompt

    def env_reset(self, *, seed: int | None = None) -> tuple[Obs, Info]:
        s = random.randrange(2**31) if seed is None else seed
        self.problem = generate_problem(s, self.digits, self.ops, self.split)
        return render_prompt(self.prompt, self.problem), {"seed": s, "answer": self.problem.answer}

    def env_step(self, action: str) -> StepOutcome:
        if self.problem is None:
            raise RuntimeError("ArithmeticEnv.env_step called before env_reset")
        reward = score_answer(action, self.problem.answer, self.partial_credit, self.partial_scale)
        return StepOutcome(
            obs="correct" if reward == 1.0 else f"wrong, the answer was {self.problem.answer}",
            reward=reward,
            terminated=True,
            info={"answer": self.problem.answer, "correct": reward == 1.0},
        )

    def env_current_obs(self) -> Obs:
        if self.problem is None:
            raise RuntimeError("ArithmeticEnv has no problem before env_reset")
        return render_prompt(self.prompt, self.problem)

    # ReferenceEnv (libludic/envs/reference.py): supervised data and checks from this env

    def reference_completion(self) -> str:
        if self.problem is None:
            raise RuntimeError("ArithmeticEnv has no problem before env_reset")
        return self.problem.answer

    def score_completion(self, completion: str, reference: str) -> float:
        return score_answer(completion, reference, self.partial_credit, self.partial_scale)

    def reference_tool_call(self) -> tuple[str, dict[str, Any]]:
        """The tool call that solves the problem: the calculator on its expression (a tool
        demonstration for a warm start, libludic/sft/tasks.py ``tool_task``)."""
        if self.problem is None:
            raise RuntimeError("ArithmeticEnv has no problem before env_reset")
        p = self.problem
        return "calculator", {"expression": f"{p.a}{p.op}{p.b}"}


def sft_task(digits: int = 2, **env_kwargs: Any) -> dict[str, Any]:
    """The demo's supervised task (``ludic sft --task arithmetic``, ``up.sft_task:
    arithmetic``), as ``libludic.sft.tasks.env_task``'s arguments. Two-digit
    addition has only 8,100 distinct problems, so training and its target check draw from
    ``split="train"`` and the held-out report from ``split="eval"`` (env seeds ``0..n-1``, the
    problems ``ludic up`` evaluates); a greedy answer gets ``2 x digits + 3`` tokens (the
    bare sum and EOS fit). ``env_kwargs`` (``ops``, ``prompt``, ...) go to both envs."""
    if "split" in env_kwargs:
        raise ValueError("the arithmetic SFT task sets split itself (train, and eval held out)")
    kwargs = {"digits": digits, **env_kwargs}
    return {
        "env": {"kind": "arithmetic", "kwargs": {**kwargs, "split": "train"}},
        "held_out_env": {"kind": "arithmetic", "kwargs": {**kwargs, "split": "eval"}},
        "max_new_tokens": 2 * digits + 3,
        "name": f"arithmetic ({digits}-digit addition)",
    }
