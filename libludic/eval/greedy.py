"""Greedy pass rate of a transformers model (in process, no server): what an SFT run checks
its target against and reports at the end. The services measure the same quantity through
inference (services/common/heldout.py).

A :class:`GreedyCheck` is a task's side of it: the problems as (user prompt, reference)
pairs, the scorer of a decoded answer against its reference (1.0 = passed), and the answer's
token budget. Any task provides one (``libludic/sft/tasks.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GreedyCheck:
    """Problems (user prompt, reference) scored by ``score(answer, reference)``, where the
    answer is the greedy completion (at most ``max_new_tokens``) decoded without special
    tokens; ``score(answer, reference, prompt)`` when ``takes_prompt`` (a task whose answer is
    judged against the problem, e.g. any legal move of a board)."""

    problems: Sequence[tuple[str, str]]
    score: Callable[..., float]
    max_new_tokens: int
    takes_prompt: bool = False

    def __post_init__(self) -> None:
        if not self.problems or self.max_new_tokens < 1:
            raise ValueError(
                f"a GreedyCheck needs problems and max_new_tokens >= 1 (got "
                f"{len(self.problems)} problems, max_new_tokens={self.max_new_tokens})"
            )


@torch.no_grad()
def greedy_pass_rate(
    model: Any, tokenizer: Any, check: GreedyCheck, batch_size: int = 100
) -> float:
    """Fraction of ``check.problems`` whose greedy answer scores 1.0."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.pad_token_id
    passed = 0
    problems = list(check.problems)
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompts = []
        for prompt, _ in chunk:
            enc = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
        T = max(len(x) for x in prompts)
        ids = torch.tensor([[pad] * (T - len(x)) + x for x in prompts], device=device)
        attn = torch.tensor([[0] * (T - len(x)) + [1] * len(x) for x in prompts], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=check.max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for (prompt, reference), row in zip(chunk, out[:, T:].tolist(), strict=True):
            text = tokenizer.decode(row, skip_special_tokens=True)
            args = (text, reference, prompt) if check.takes_prompt else (text, reference)
            passed += int(check.score(*args) == 1.0)
    model.train(was_training)
    return passed / len(problems)
