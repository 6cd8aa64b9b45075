"""Greedy pass rate of a transformers model on arithmetic problems (in process, no server):
what the SFT warm start checks and reports. The services measure the same quantity through
inference (services/common/heldout.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from libludic.envs.arithmetic import generate_problem, score_answer


@torch.no_grad()
def greedy_pass_rate(
    model: Any,
    tokenizer: Any,
    seeds: Sequence[int],
    digits: int,
    batch_size: int = 100,
    split: str = "eval",
) -> float:
    """Fraction of problems ``generate_problem(s, digits, split=split)`` whose greedy answer
    (stripped) equals the target."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.pad_token_id
    probs = [generate_problem(s, digits, split=split) for s in seeds]
    passed = 0
    for start in range(0, len(probs), batch_size):
        chunk = probs[start : start + batch_size]
        prompts = []
        for p in chunk:
            enc = tokenizer.apply_chat_template(
                [{"role": "user", "content": p.question}], add_generation_prompt=True, tokenize=True
            )
            prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
        T = max(len(x) for x in prompts)
        ids = torch.tensor([[pad] * (T - len(x)) + x for x in prompts], device=device)
        attn = torch.tensor([[0] * (T - len(x)) + [1] * len(x) for x in prompts], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=2 * digits + 3,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for p, row in zip(chunk, out[:, T:].tolist(), strict=True):
            text = tokenizer.decode(row, skip_special_tokens=True)
            passed += int(score_answer(text, p.answer) == 1.0)
    model.train(was_training)
    return passed / max(len(probs), 1)
