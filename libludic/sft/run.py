"""Supervised fine-tuning of a model directory on any dataset (``run_sft``; its command line
is ``ludic sft``, libludic/sft/cli.py).

Data: a JSONL file of ``{"prompt": ..., "completion": ...}`` pairs or chat samples
``{"messages": [..., {"role": "assistant", ...}]}``, read through OfflineBatchSource with
``make_sft()`` (the same path any SFT run takes): the trained action is the completion
followed by the tokenizer's EOS. A task (``sft_tasks.py``) writes such a file and brings its
greedy checks.

``lr_schedule="constant"`` (default) keeps ``lr``; ``"linear"`` decays it to 0 over
``steps``. ``check`` with ``target_pass_rate`` makes ``steps`` a limit: every ``check_every``
steps the greedy pass rate on ``check``'s problems is measured and training stops at the
first check that reaches the target (every step once a check is within ``FINE_MARGIN`` of
it, or half the target when that is less: near a steep part of the curve the pass rate can
move 0.1 in a few steps, and a target of 0.1 is not near from 0), so the start
lands just above the target whatever the seed or machine. Not reaching it within ``steps``
is an error. ``held_out``, measured once at the end, is what the run reports; it is never
looked at before.

Output: the trained model and tokenizer in ``out_dir`` (``save_pretrained``), a progress
line every ``log_every`` steps and, with ``held_out``, its greedy pass rate.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from libludic.eval.greedy import GreedyCheck, greedy_pass_rate
from libludic.training.batching.offline import OfflineBatchSource
from libludic.training.config import TrainerConfig
from libludic.training.presets import make_sft
from libludic.training.trainer import Trainer

__all__ = ["run_sft", "FINE_MARGIN"]

FINE_MARGIN = 0.1  # within this of the target (at most half the target), check every step


def run_sft(
    model_dir: str | Path,
    out_dir: str | Path,
    data: str | Path,
    *,
    steps: int = 600,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    log_every: int = 50,
    device: str | None = None,
    quiet: bool = False,
    lr_schedule: str = "constant",
    check: GreedyCheck | None = None,
    target_pass_rate: float = 0.0,
    check_every: int = 10,
    held_out: GreedyCheck | None = None,
    max_seq_len: int = 256,
) -> dict[str, Any]:
    """Train on ``data``, save to ``out_dir``, evaluate ``held_out``; returns losses,
    pass_rate (NaN without ``held_out``), steps_run, checks and timings."""
    if lr_schedule not in ("constant", "linear"):
        raise ValueError(f"lr_schedule={lr_schedule!r}: use 'constant' or 'linear' (decay to 0)")
    if not 0.0 <= target_pass_rate <= 1.0 or check_every < 1:
        raise ValueError(
            f"target_pass_rate={target_pass_rate} must be in [0, 1] (0: off) and "
            f"check_every={check_every} >= 1"
        )
    if target_pass_rate > 0 and check is None:
        raise ValueError("target_pass_rate needs a check (the problems it is measured on)")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps={steps} and batch_size={batch_size} must be >= 1")
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    source = OfflineBatchSource(
        Path(data), batch_size=batch_size, tokenizer=tok, algorithm=make_sft(), seed=seed
    )
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainerConfig(
        model_device=dev,
        lr=lr,
        pad_token_id=int(tok.pad_token_id),
        max_seq_len=max_seq_len,
        mixed_precision_dtype="bf16" if dev.startswith("cuda") else None,
        log_every=max(log_every, 1),
        lr_scheduler_type=lr_schedule,  # linear: decay to 0, a converged, stable endpoint
        total_steps=steps,
        warmup_steps_proportion=0.0,
    )
    trainer = Trainer(model=model, algo=make_sft(), batch_source=source, cfg=cfg)
    say = (lambda *_a, **_k: None) if quiet else print
    say(
        f"sft: {len(source)} training samples from {data}, {steps} steps x {batch_size}, lr {lr}, {dev}"
    )
    losses: list[float] = []
    checks: list[dict[str, float]] = []
    t0 = time.perf_counter()
    # a target below FINE_MARGIN would be "near" from a pass rate of 0: every step checked
    margin = min(FINE_MARGIN, target_pass_rate / 2)

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
            near = bool(checks) and checks[-1]["train_pass_rate"] >= target_pass_rate - margin
            if check is not None and target_pass_rate > 0 and (i % check_every == 0 or near):
                rate = greedy_pass_rate(trainer.model, tok, check)
                checks.append({"step": i, "train_pass_rate": rate})
                if rate >= target_pass_rate:
                    say(
                        f"step {i}: greedy pass rate {rate:.3f} >= target {target_pass_rate}; stopping"
                    )
                    return

    asyncio.run(loop())
    train_s = time.perf_counter() - t0
    if target_pass_rate > 0 and (not checks or checks[-1]["train_pass_rate"] < target_pass_rate):
        last = f"{checks[-1]['train_pass_rate']:.3f}" if checks else "none"
        raise ValueError(  # the values given cannot produce the start asked for
            f"sft: the greedy pass rate did not reach target_pass_rate={target_pass_rate} "
            f"within steps={steps} (last check: {last}); raise steps or lower the target"
        )
    trainer.model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    tok.save_pretrained(out)
    pass_rate = float("nan")
    if held_out is not None:
        pass_rate = greedy_pass_rate(trainer.model, tok, held_out)
        say(
            f"greedy pass rate on {len(held_out.problems)} held-out problems: {pass_rate:.3f}  "
            f"(training {train_s:.1f} s, model saved to {out})"
        )
    else:
        say(f"training {train_s:.1f} s, model saved to {out} (no held-out evaluation)")
    return {
        "losses": losses,
        "pass_rate": pass_rate,
        "train_s": train_s,
        "num_samples": len(source),
        "steps_run": len(losses),
        "checks": checks,
    }
