"""torchrun worker for test_batch_stage_fsdp2.py: ScaleRL under FSDP2 (gloo, CPU) with the
batch split across ranks, and GRPO with a KL term (reference model on every rank).

    python -m torch.distributed.run --standalone --nproc_per_node 2 batch_stage_worker.py MODEL_DIR OUT_DIR

Rank 0 gets group a's credit-worker items (rewards 0,0,0,1), rank 1 group b's (0,0,0,5),
both with the batch stage pending. Each rank writes the weights its loss saw and the KL of
two GRPO+KL steps to OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.saw import SAWBatch
from libludic.training.config import TrainerConfig
from libludic.training.loss import loss_inputs
from libludic.training.presets import make_grpo, make_scalerl
from libludic.training.trainer import Trainer
from libludic.types import Rollout, Step, TokenTrace


def rollout(gid: str, i: int, reward: float) -> Rollout:
    tr = TokenTrace([257, 49, 43, 50], [51, 258], [-0.25, -0.5])
    step = Step(0, "q", "a", None, reward, terminated=True, trace=tr, policy_version=0)
    return Rollout(id=f"{gid}{i}", steps=[step], meta={"group_id": gid})


class Fixed:
    def __init__(self, items):
        self.items = items

    async def next_batch(self) -> SAWBatch:
        return SAWBatch(items=list(self.items))


class Recording:
    def __init__(self, inner, seen) -> None:
        self.inner, self.seen = inner, seen
        self.requires = loss_inputs(inner)

    def compute(self, logits, batch):
        self.seen.extend(float(x) for x in batch["weight"])
        return self.inner.compute(logits, batch)


def main() -> int:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = TrainerConfig(
        model_device="cpu", mixed_precision_dtype=None, lr=1e-2, pad_token_id=PAD_ID
    )
    algo = make_scalerl(group_size=4, filter_zvp=False)
    gid, rewards = [("a", [0, 0, 0, 1]), ("b", [0, 0, 0, 5])][rank]
    items = algo.to_saw_items(
        [rollout(gid, i, r) for i, r in enumerate(rewards)], defer_batch_stage=True
    )
    seen: list = []
    algo.loss = Recording(algo.loss, seen)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tr = Trainer(model=model, algo=algo, batch_source=Fixed(items), cfg=cfg)
    asyncio.run(tr.train_step())

    kl_items = make_grpo(group_size=4).to_saw_items(
        [rollout(gid, i, r) for i, r in enumerate(rewards)]
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tk = Trainer(
        model=model,
        algo=make_grpo(group_size=4, kl_coeff=0.1),
        batch_source=Fixed(kl_items),
        cfg=cfg,
    )
    assert tk.ref_model is not None
    ref_params = list(tk.ref_model.parameters())
    ref_sharded = sum(1 for p in ref_params if type(p).__name__ == "DTensor") / len(ref_params)
    kl = [asyncio.run(tk.train_step())["loss/kl/kl"] for _ in range(2)]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(
        json.dumps({"weights": seen, "kl": kl, "ref_sharded": ref_sharded})
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
