"""Data of the arithmetic SFT warm start (``run_sft``): chat samples and the seed ranges.

Training problems are ``generate_problem(TRAIN_SEED_BASE + i, split="train")``; the held-out
evaluation uses ``split="eval"`` seeds ``EVAL_SEEDS`` (the set `ludic up` evaluates on);
``CHECK_SEEDS`` are train-split problems for the ``target_pass_rate`` checks, so the
held-out set is never looked at during training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from libludic.envs.arithmetic import generate_problem

TRAIN_SEED_BASE = 10_000_000
EVAL_SEEDS = range(0, 200)
CHECK_SEEDS = range(20_000_000, 20_000_200)  # train-split problems for target_pass_rate


def chat_record(question: str, answer: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    }


def write_train_jsonl(path: Path, n: int, digits: int, exclude: set[str]) -> int:
    """Write ``n`` training samples (fewer if some collide with ``exclude``); returns count."""
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            p = generate_problem(TRAIN_SEED_BASE + i, digits, split="train")
            if p.question in exclude:
                continue
            f.write(json.dumps(chat_record(p.question, p.answer)) + "\n")
            written += 1
    return written
