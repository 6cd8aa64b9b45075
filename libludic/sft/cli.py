"""``ludic sft``: the command line of ``libludic.sft.run.run_sft`` (see its module
docstring), on a JSONL file or on a task's data (``libludic/sft/tasks.py``).

    ludic sft --model DIR --out DIR --data pairs.jsonl [--steps 600] [--batch-size 64]
              [--lr 1e-3] [--seed 0] [--lr-schedule constant|linear]
    ludic sft --model DIR --out DIR --task arithmetic [--task-arg digits=3] [--eval-n 200]
              [--target-pass-rate 0.55 --check-every 5]
    ludic sft --model DIR --out DIR --task env \
              --task-arg 'env={kind: dataset_qa, kwargs: {path: train.jsonl}}' \
              --task-arg 'held_out_env={kind: dataset_qa, kwargs: {path: test.jsonl}}'

With ``--task`` the task writes ``<out>/sft_train.jsonl`` (``--steps x --batch-size``
records), ``--target-pass-rate`` stops on its check, and the held-out pass rate on its first
``--eval-n`` problems is reported at the end. ``--task-arg KEY=VALUE`` (repeated) gives the
task's keyword arguments, each VALUE read as YAML (``3``, ``[+, -]``, ``{kind: ...}``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from libludic.sft.run import run_sft
from libludic.sft.tasks import TASKS, make_task


def task_args(items: list[str]) -> dict[str, Any]:
    """``["digits=3", "ops=[+, -]"]`` -> ``{"digits": 3, "ops": ["+", "-"]}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--task-arg {item!r}: write KEY=VALUE, e.g. digits=3")
        out[key.strip()] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ludic sft",
        description="supervised fine-tuning of a model directory on a JSONL file or a task",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="model directory (e.g. from `ludic model init`)")
    ap.add_argument("--out", required=True, help="where to save the trained model")
    data = ap.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help='JSONL: {"prompt", "completion"} or {"messages"} per line')
    data.add_argument("--task", choices=sorted(TASKS), help="a task's training data and checks")
    ap.add_argument(
        "--task-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a keyword argument of --task (repeat; VALUE is YAML), e.g. digits=3",
    )
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-n", type=int, default=200, help="--task: held-out problems reported")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--lr-schedule", default="constant", choices=["constant", "linear"])
    ap.add_argument(
        "--target-pass-rate",
        type=float,
        default=0.0,
        help="--task: stop once the greedy pass rate on its check reaches this (0: off)",
    )
    ap.add_argument(
        "--check-every", type=int, default=10, help="steps between --target-pass-rate checks"
    )
    a = ap.parse_args(argv)
    if a.steps < 1 or a.batch_size < 1:
        ap.error("--steps and --batch-size must be >= 1")
    task = None
    if a.data is not None:
        if a.target_pass_rate:
            ap.error("--target-pass-rate needs --task (a file brings no check to measure)")
        if a.task_arg:
            ap.error("--task-arg needs --task")
        if not Path(a.data).is_file():
            ap.error(f"--data {a.data}: no such file")
    else:
        try:
            task = make_task({"kind": a.task, "kwargs": task_args(a.task_arg)})
        except ValueError as e:
            ap.error(str(e))
        if not 0 <= a.eval_n <= task.max_held_out:
            ap.error(f"--eval-n must be in [0, {task.max_held_out}]")
    run_sft(
        a.model,
        a.out,
        a.data if task is None else task.data_in(Path(a.out), a.steps * a.batch_size),
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        seed=a.seed,
        log_every=a.log_every,
        device=a.device,
        lr_schedule=a.lr_schedule,
        check=None if task is None else task.check,
        target_pass_rate=a.target_pass_rate,
        check_every=a.check_every,
        held_out=task.held_out(a.eval_n) if task is not None and a.eval_n else None,
    )
    return 0
