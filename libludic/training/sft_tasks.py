"""What a task gives supervised training (``run_sft``): prompt/completion pairs to train on,
and greedy checks (``GreedyCheck``) for the target stop and the held-out report.

``TASKS`` names the tasks ``ludic sft --task`` and ``ludic up``'s warm start know. Any other
dataset is a JSONL file (``ludic sft --data``): one ``{"prompt": ..., "completion": ...}`` or
``{"messages": [...]}`` record per line.

``arithmetic`` (the demo, ``libludic.envs.arithmetic``): two-digit addition has only 8100
distinct problems, so the problem space itself is split (``split="train"`` never yields a
held-out problem). Training pairs are ``generate_problem(TRAIN_SEED_BASE + i,
split="train")`` minus any question among the held-out ones (a second guard);
``held_out(n)`` is ``split="eval"`` seeds ``0..n-1``, the problems ``ludic up`` evaluates
on; ``check`` is 200 train-split problems (``CHECK_SEEDS``), so a target stop never looks
at the held-out set.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from libludic.envs.arithmetic import generate_problem, score_answer
from libludic.eval.greedy import GreedyCheck

TRAIN_SEED_BASE = 10_000_000
HELD_OUT_SEEDS = range(0, 200)
CHECK_SEEDS = range(20_000_000, 20_000_200)


@dataclass(frozen=True)
class SFTTask:
    """``write(path, n)`` writes up to ``n`` training records to ``path`` (JSONL) and returns
    how many; ``check`` is what a target stop measures; ``held_out(n)`` the first ``n``
    held-out problems (at most ``max_held_out``)."""

    name: str
    write: Callable[[Path, int], int]
    check: GreedyCheck
    held_out: Callable[[int], GreedyCheck]
    max_held_out: int

    def data_in(self, out_dir: Path, n: int) -> Path:
        """Write up to ``n`` training records to ``out_dir/sft_train.jsonl``; its path."""
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "sft_train.jsonl"
        self.write(path, n)
        return path


def record(prompt: str, completion: str) -> dict[str, str]:
    return {"prompt": prompt, "completion": completion}


def arithmetic(digits: int = 2) -> SFTTask:
    """The demo's task (module docstring)."""

    def check_of(seeds: range, split: str) -> GreedyCheck:
        probs = [generate_problem(s, digits, split=split) for s in seeds]
        return GreedyCheck([(p.question, p.answer) for p in probs], score_answer, 2 * digits + 3)

    def held_out(n: int) -> GreedyCheck:
        return check_of(HELD_OUT_SEEDS[:n], "eval")

    def write(path: Path, n: int) -> int:
        exclude = {q for q, _ in held_out(len(HELD_OUT_SEEDS)).problems}
        written = 0
        with open(path, "w", encoding="utf-8") as f:
            for i in range(n):
                p = generate_problem(TRAIN_SEED_BASE + i, digits, split="train")
                if p.question not in exclude:
                    f.write(json.dumps(record(p.question, p.answer)) + "\n")
                    written += 1
        return written

    return SFTTask(
        name=f"arithmetic ({digits}-digit addition)",
        write=write,
        check=check_of(CHECK_SEEDS, "train"),
        held_out=held_out,
        max_held_out=len(HELD_OUT_SEEDS),
    )


TASKS: dict[str, Callable[..., SFTTask]] = {"arithmetic": arithmetic}
