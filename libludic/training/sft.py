"""Supervised warm start of a model directory on the arithmetic task (``run_sft``; its
command line is ``ludic sft``, libludic/training/sft_cli.py; the data is sft_data.py, the
greedy evaluation libludic/eval/greedy.py).

Data: chat samples ``[{"role": "user", "content": "12+34="}, {"role": "assistant",
"content": "46"}]``; the trained action is the answer followed by ``<|im_end|>``. They are
written to ``{out}/sft_train.jsonl`` and read back through OfflineBatchSource with
``make_sft()`` (the same path any SFT run takes).

Held-out split: two-digit addition has only 8100 distinct problems, so the problem space
itself is split (``libludic.envs.arithmetic``: ``split="train"`` never yields an eval
problem). Training problems are ``generate_problem(10_000_000 + i, split="train")``;
evaluation uses ``generate_problem(s, split="eval")`` for seeds ``0..199``, the same
held-out set `ludic up` evaluates on, so the reported pass rate is on problems never
trained on (the explicit question filter below is a second guard). ``--seed`` sets the data order and torch's seed.

``--lr-schedule constant`` (default) keeps ``--lr``; the endpoint then depends on the last
noisy steps and, at lr 1e-3, on when the run leaves its ~0.1 plateau, which varies with the
seed and the machine (here seed 1 left it near step 480, seed 0 was still on it at 700).
``linear`` decays it to 0 for a converged endpoint (600 steps reached 1.000 greedy here),
which leaves RL nothing to improve. ``--target-pass-rate T`` (the demo's warm start) makes
``--steps`` a limit: every ``--check-every`` steps the greedy pass rate on 200 train-split
problems (``CHECK_SEEDS``, never the held-out ones) is measured and training stops at the
first check that reaches T (every step once a check is within 0.1 of T), so the start lands
just above T whatever the seed or machine.

Output: the trained model and tokenizer in ``--out`` (``save_pretrained``), a progress
line every ``--log-every`` steps and, at the end, the greedy pass rate on the 200 held-out
problems (exact match of the stripped decoded answer).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from libludic.envs.arithmetic import generate_problem
from libludic.eval.greedy import greedy_pass_rate
from libludic.training.batching.offline import OfflineBatchSource
from libludic.training.config import TrainerConfig
from libludic.training.presets import make_sft
from libludic.training.sft_data import CHECK_SEEDS, EVAL_SEEDS, write_train_jsonl
from libludic.training.trainer import Trainer

__all__ = [
    "run_sft",
    "greedy_pass_rate",
    "write_train_jsonl",
    "EVAL_SEEDS",
    "CHECK_SEEDS",
    "FINE_MARGIN",
]

FINE_MARGIN = 0.1  # within this of the target, check every step


def run_sft(
    model_dir: str,
    out_dir: str,
    *,
    steps: int = 600,
    batch_size: int = 64,
    lr: float = 1e-3,
    digits: int = 2,
    seed: int = 0,
    log_every: int = 50,
    eval_n: int = 200,
    device: str | None = None,
    quiet: bool = False,
    lr_schedule: str = "constant",
    target_pass_rate: float = 0.0,
    check_every: int = 10,
) -> dict[str, Any]:
    """Train, save to ``out_dir``, evaluate; returns losses, pass_rate, steps_run, timings.

    ``target_pass_rate`` > 0: every ``check_every`` steps measure the greedy pass rate on
    the 200 train-split problems ``CHECK_SEEDS`` and stop at the first check that reaches
    it (every step once a check is within ``FINE_MARGIN``; ``steps`` is then the limit, not
    reaching it is an error). The held-out set is
    never looked at before the end."""
    if lr_schedule not in ("constant", "linear"):
        raise ValueError(f"lr_schedule={lr_schedule!r}: use 'constant' or 'linear' (decay to 0)")
    if not 0.0 <= target_pass_rate <= 1.0 or check_every < 1:
        raise ValueError(
            f"target_pass_rate={target_pass_rate} must be in [0, 1] (0: off) and check_every={check_every} >= 1"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eval_seeds = list(EVAL_SEEDS)[:eval_n]
    exclude = {generate_problem(s, digits, split="eval").question for s in eval_seeds}
    data = out / "sft_train.jsonl"
    n = write_train_jsonl(data, steps * batch_size, digits, exclude)
    source = OfflineBatchSource(
        data, batch_size=batch_size, tokenizer=tok, algorithm=make_sft(), seed=seed
    )
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainerConfig(
        model_device=dev,
        lr=lr,
        pad_token_id=int(tok.pad_token_id),
        max_seq_len=256,
        mixed_precision_dtype="bf16" if dev.startswith("cuda") else None,
        log_every=max(log_every, 1),
        lr_scheduler_type=lr_schedule,  # linear: decay to 0, a converged, stable endpoint
        total_steps=steps,
        warmup_steps_proportion=0.0,
    )
    trainer = Trainer(model=model, algo=make_sft(), batch_source=source, cfg=cfg)
    say = (lambda *_a, **_k: None) if quiet else print
    say(
        f"sft: {n} training samples ({digits}-digit addition), {steps} steps x {batch_size}, lr {lr}, {dev}"
    )
    losses: list[float] = []
    checks: list[dict[str, float]] = []
    t0 = time.perf_counter()

    async def loop() -> None:
        window: list[float] = []
        for i in range(1, steps + 1):
            st = await trainer.train_step()
            losses.append(st["loss"])
            window.append(st["loss"])
            if log_every and (i % log_every == 0 or i == steps):
                acc = st.get("loss/token_accuracy", float("nan"))
                say(
                    f"step {i}/{steps} loss {sum(window) / len(window):.4f} "
                    f"token_acc {acc:.3f} ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
                window = []
            # every check_every steps; every step once within FINE_MARGIN of the target (the
            # pass rate can jump 0.1 in 5 steps near the transition: finer checks, less overshoot)
            near = bool(checks) and checks[-1]["train_pass_rate"] >= target_pass_rate - FINE_MARGIN
            if target_pass_rate > 0 and (i % check_every == 0 or near):
                rate = greedy_pass_rate(trainer.model, tok, CHECK_SEEDS, digits, split="train")
                checks.append({"step": i, "train_pass_rate": rate})
                if rate >= target_pass_rate:
                    say(
                        f"step {i}: train-split greedy pass rate {rate:.3f} >= target {target_pass_rate}; stopping"
                    )
                    return

    asyncio.run(loop())
    train_s = time.perf_counter() - t0
    if target_pass_rate > 0 and (not checks or checks[-1]["train_pass_rate"] < target_pass_rate):
        last = f"{checks[-1]['train_pass_rate']:.3f}" if checks else "none"
        raise ValueError(  # the values given cannot produce the start asked for
            f"sft: the train-split greedy pass rate did not reach target_pass_rate={target_pass_rate} within "
            f"steps={steps} (last check: {last}); raise steps or lower the target"
        )
    trainer.model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    tok.save_pretrained(out)
    pass_rate = greedy_pass_rate(trainer.model, tok, eval_seeds, digits) if eval_n else float("nan")
    if eval_n:
        say(
            f"greedy pass rate on {len(eval_seeds)} held-out problems (seeds 0..{len(eval_seeds) - 1}): "
            f"{pass_rate:.3f}  (training {train_s:.1f} s, model saved to {out})"
        )
    else:
        say(f"training {train_s:.1f} s, model saved to {out} (no held-out evaluation: eval_n=0)")
    return {
        "losses": losses,
        "pass_rate": pass_rate,
        "train_s": train_s,
        "num_samples": n,
        "steps_run": len(losses),
        "checks": checks,
    }
