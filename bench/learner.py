"""Learner throughput: Trainer vs a bare PyTorch loop on the same model and batches.

Both sides train the ``small`` tiny model (same initial weights) on the same fixed synthetic
SAW batches with the SFT objective (mean NLL of action tokens): forward, backward, grad-norm
clipping at 1.0, AdamW. The Trainer additionally packs, collates (padding) and computes its
loss stats; the bare loop gets pre-padded tensors. Timing blocks alternate between the two
so that load from other processes on the machine hits both alike.

tokens/s counts real (unpadded) tokens. Last line:
``RESULT learner tokens_per_s=<x> baseline_tokens_per_s=<y> ratio=<x/y>``, ``ratio`` =
Trainer tokens/s / bare loop tokens/s (higher is better; 1.0 = the Trainer costs nothing
over the bare loop).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libludic.models.tiny import PAD_ID, init_model  # noqa: E402
from libludic.saw import SampleAttachments, SAWBatch, SAWItem  # noqa: E402
from libludic.training.collate import collate  # noqa: E402
from libludic.training.config import TrainerConfig  # noqa: E402
from libludic.training.presets import make_sft  # noqa: E402
from libludic.training.trainer import Trainer, TrainerHooks  # noqa: E402


def synthetic_batches(n: int, batch_size: int, seed: int = 0) -> list[list[SAWItem]]:
    """Arithmetic-shaped items: 20-28 state tokens, 3-6 action tokens."""
    rng = random.Random(seed)
    out = []
    for b in range(n):
        items = []
        for i in range(batch_size):
            ns, na = rng.randint(20, 28), rng.randint(3, 6)
            ids = [rng.randrange(256) for _ in range(ns + na)]
            items.append(
                SAWItem(
                    input_ids=ids,
                    attention_mask=[1] * (ns + na),
                    action_mask=[0] * ns + [1] * na,
                    weight=1.0,
                    meta={"item_id": f"{b}:{i}"},
                    attachments=SampleAttachments(policy_version=0),
                )
            )
        out.append(items)
    return out


class CycleSource:
    def __init__(self, batches: list[list[SAWItem]]) -> None:
        self.batches, self.i = batches, 0

    async def next_batch(self) -> SAWBatch:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return SAWBatch(items=b)


def bare_step(model, opt, t: dict[str, torch.Tensor]) -> None:
    logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
    lg = logits[:, :-1]
    logp = lg.gather(-1, t["input_ids"][:, 1:, None]).squeeze(-1) - torch.logsumexp(lg, -1)
    m = t["action_mask"][:, 1:].float()
    loss = -(logp * m).sum() / m.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="< 60 s")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per block")
    ap.add_argument("--blocks", type=int, default=None, help="alternating timing blocks")
    a = ap.parse_args(argv)
    bs = 32 if a.quick else a.batch_size
    steps = a.steps or (3 if a.quick else 10)
    blocks = a.blocks or (3 if a.quick else 5)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        init_model(Path(d) / "small", "small", seed=0)
        m_tr = AutoModelForCausalLM.from_pretrained(Path(d) / "small", dtype=torch.float32)
        m_bare = AutoModelForCausalLM.from_pretrained(Path(d) / "small", dtype=torch.float32)
    batches = synthetic_batches(8, bs)
    real_tokens = [sum(it.num_tokens for it in b) for b in batches]
    cfg = TrainerConfig(
        model_device="cpu",
        mixed_precision_dtype=None,
        lr=1e-3,
        pad_token_id=PAD_ID,
        micro_token_budget=1 << 20,
    )
    trainer = Trainer(
        model=m_tr,
        algo=make_sft(),
        batch_source=CycleSource(batches),
        cfg=cfg,
        hooks=TrainerHooks(on_log=None),  # no console line inside the timed steps
    )
    opt = torch.optim.AdamW(
        m_bare.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
    )
    padded = [collate(b, PAD_ID) for b in batches]

    async def trainer_steps(k: int) -> None:
        for _ in range(k):
            await trainer.train_step()

    # warm-up (allocator, first-call overheads)
    asyncio.run(trainer_steps(2))
    for i in range(2):
        bare_step(m_bare, opt, padded[i % len(padded)])
    tr_time = tr_tok = bare_time = bare_tok = 0.0
    bi = 0
    for blk in range(blocks):
        start_i = trainer.batch_source.i
        t0 = time.perf_counter()
        asyncio.run(trainer_steps(steps))
        tr_time += time.perf_counter() - t0
        tr_tok += sum(real_tokens[(start_i + j) % len(batches)] for j in range(steps))
        t0 = time.perf_counter()
        for _ in range(steps):
            bare_step(m_bare, opt, padded[bi % len(padded)])
            bare_tok += real_tokens[bi % len(batches)]
            bi += 1
        bare_time += time.perf_counter() - t0
        print(
            f"block {blk + 1}/{blocks}: trainer {tr_tok / tr_time:.0f} tok/s, "
            f"bare {bare_tok / bare_time:.0f} tok/s (cumulative)",
            flush=True,
        )
    x, y = tr_tok / tr_time, bare_tok / bare_time
    extra = ""
    svc = service_path(bs, steps * blocks, cfg)
    if svc is not None:
        s_tok, pub_s = svc
        print(f"service path: {s_tok:.0f} tok/s, publish {pub_s:.3f} s/step", flush=True)
        extra = (
            f" service_tokens_per_s={s_tok:.1f} service_ratio={s_tok / x:.3f}"
            f" publish_s_per_step={pub_s:.3f}"
        )
    print(
        f"RESULT learner tokens_per_s={x:.1f} baseline_tokens_per_s={y:.1f} ratio={x / y:.3f}{extra}"
    )
    return 0


# ----------------------------------------------------------------------------- service path


def service_path(bs: int, steps: int, cfg: TrainerConfig, publish_steps: int = 3):
    """The ``ludic learner`` data path: items XADDed to a real redis-server, read by
    PipelineBatchSource (consumer group, ack after each step as without checkpoints) into
    the same Trainer and model; plus the HTTP publish (safetensors of the full state dict)
    to the inference app around a fake engine (tests/fakes.py: validated as the service
    does, no vLLM reload), seconds per publish. Returns (tokens/s, publish s/step), or
    None when no redis-server is on PATH."""
    import shutil
    import socket
    import subprocess

    exe = shutil.which("redis-server")
    if exe is None:
        print("service path skipped: no redis-server on PATH", flush=True)
        return None
    from transformers import AutoModelForCausalLM

    from libludic import transport as t
    from libludic.distributed.publisher import HttpPolicyPublisher, ReplicaSet
    from libludic.training.batching.pipeline import PipelineBatchSource

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                d,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            init_model(Path(d) / "small", "small", seed=0)
            model = AutoModelForCausalLM.from_pretrained(Path(d) / "small", dtype=torch.float32)
            batches = synthetic_batches(steps + 2, bs, seed=1)
            real = [sum(it.num_tokens for it in b) for b in batches]

            async def go():
                url = f"redis://127.0.0.1:{port}/0"
                for _ in range(100):
                    try:
                        r = t.connect(url)
                        await r.ping()
                        break
                    except Exception:
                        await asyncio.sleep(0.05)
                keys = t.Keys("bench")
                for b in batches:
                    for it in b:
                        await t.xadd(r, keys.saw, it.item_id, t.encode_saw_item(it))
                src = PipelineBatchSource(redis=r, keys=keys, batch_size=bs, block_ms=100)
                await src.start()
                trainer = Trainer(model=model, algo=make_sft(), batch_source=src, cfg=cfg)
                for _ in range(2):  # warm-up
                    await trainer.train_step()
                    src.mark_trained()
                    await src.commit()
                t0 = time.perf_counter()
                for _ in range(steps):
                    await trainer.train_step()
                    src.mark_trained()
                    await src.commit()
                dt = time.perf_counter() - t0
                await r.aclose()
                return sum(real[2:]) / dt, trainer

            tok_s, trainer = asyncio.run(go())
            from tests.fakes import ServedApp, TensorEngine

            small = Path(d) / "small"
            with ServedApp(TensorEngine.of_model(small), small) as fake:
                pub = HttpPolicyPublisher(ReplicaSet([fake.url]))
                t0 = time.perf_counter()
                for v in range(1, publish_steps + 1):
                    pub.publish(trainer.full_state_dict(), v)
                pub_s = (time.perf_counter() - t0) / publish_steps
            return tok_s, pub_s
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
