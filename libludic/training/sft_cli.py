"""``ludic sft``: the command line of ``libludic.training.sft.run_sft`` (see its module
docstring for the recipe).

    ludic sft --model DIR --out DIR [--steps 600] [--batch-size 64] [--lr 1e-3]
              [--digits 2] [--seed 0] [--lr-schedule constant|linear]
              [--target-pass-rate 0.55 --check-every 5]
"""

from __future__ import annotations

import argparse

from libludic.training.sft import run_sft
from libludic.training.sft_data import EVAL_SEEDS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ludic sft",
        description="supervised warm start of a model directory on the arithmetic task",
    )
    ap.add_argument("--model", required=True, help="model directory (e.g. from `ludic model init`)")
    ap.add_argument("--out", required=True, help="where to save the trained model")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-n", type=int, default=200, help="held-out problems (seeds 0..N-1)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--lr-schedule", default="constant", choices=["constant", "linear"])
    ap.add_argument(
        "--target-pass-rate",
        type=float,
        default=0.0,
        help="stop once the greedy pass rate on 200 train-split problems reaches this (0: off)",
    )
    ap.add_argument(
        "--check-every", type=int, default=10, help="steps between --target-pass-rate checks"
    )
    a = ap.parse_args(argv)
    if a.steps < 1 or a.batch_size < 1:
        ap.error("--steps and --batch-size must be >= 1")
    if not 0 <= a.eval_n <= len(EVAL_SEEDS):
        ap.error(f"--eval-n must be in [0, {len(EVAL_SEEDS)}]")
    run_sft(
        a.model,
        a.out,
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        digits=a.digits,
        seed=a.seed,
        log_every=a.log_every,
        eval_n=a.eval_n,
        device=a.device,
        lr_schedule=a.lr_schedule,
        target_pass_rate=a.target_pass_rate,
        check_every=a.check_every,
    )
    return 0
