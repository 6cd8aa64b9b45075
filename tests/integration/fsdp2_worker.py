"""torchrun worker for test_fsdp2.py: one FSDP2 (gloo, CPU) train step, then gather weights.

    python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp2_worker.py MODEL_DIR OUT_DIR [SPLIT] [ALGO]

Rank r trains on its share of a fixed batch (the union over ranks is the whole batch):
SPLIT "even" (the default) gives it items[r::world]; "uneven" gives rank 0 the first item
and rank 1 the rest, so the ranks pack different numbers of micro-batches. ALGO "sft" (the
default) or "kl" (GRPO's surrogate plus a KL term: the Trainer builds the frozen reference)
or "ppo" (make_ppo: the Trainer builds a critic, sharded like the policy, and writes its
gathered state to OUT_DIR/rank{r}_critic.safetensors).
As the learner does, only rank 0 loads the weights; the other ranks pass the architecture on
the meta device, and the Trainer fills their shards from rank 0. It publishes once through a
recording publisher, and writes the gathered full state dict to OUT_DIR/rank{r}.safetensors
plus OUT_DIR/rank{r}.json with its step stats.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.saw import SampleAttachments, SAWBatch, SAWItem
from libludic.training import parallel
from libludic.training.algorithm import RLAlgorithm
from libludic.training.config import TrainerConfig
from libludic.training.presets import make_grpo, make_ppo, make_sft
from libludic.training.trainer import Trainer

KL_COEFF = 0.5


def fixed_items(n: int = 8) -> list[SAWItem]:
    out = []
    for i in range(n):
        ns, na = 4 + i % 3, 2 + i % 4
        ids = [(13 * i + 7 * t + 1) % 250 for t in range(ns + na)]
        out.append(
            SAWItem(
                input_ids=ids,
                attention_mask=[1] * len(ids),
                action_mask=[0] * ns + [1] * na,
                weight=1.0 if i % 2 else -0.5,
                # two items per rollout: ppo's GAE joins them (each rank holds both: even split)
                meta={"item_id": str(i), "rollout_id": f"r{i % 4}", "step_index": i // 4},
                attachments=SampleAttachments(
                    actor_logprobs=[0.0] * ns + [-5.5] * na, policy_version=0
                ),
            )
        )
    return out


def config() -> TrainerConfig:
    return TrainerConfig(
        model_device="cpu",
        mixed_precision_dtype=None,
        lr=1e-2,
        pad_token_id=PAD_ID,
        micro_token_budget=24,  # several micro-batches per rank
    )


def algorithm(name: str) -> RLAlgorithm:
    if name == "ppo":
        return make_ppo(gamma=0.9, gae_lambda=0.8)
    return make_sft() if name == "sft" else make_grpo(kl_coeff=KL_COEFF)


class Fixed:
    def __init__(self, items):
        self.items = items

    async def next_batch(self) -> SAWBatch:
        return SAWBatch(items=list(self.items))


class Recorder:
    def __init__(self) -> None:
        self.calls = []

    def publish(self, state_dict, version) -> None:
        self.calls.append((version, len(state_dict)))


def share(rank: int, world: int, split: str) -> list[SAWItem]:
    items = fixed_items()
    if split == "even":
        return items[rank::world]
    assert split == "uneven" and world == 2, (split, world)
    return items[:1] if rank == 0 else items[1:]


def main() -> int:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    split = sys.argv[3] if len(sys.argv) > 3 else "even"
    algo = sys.argv[4] if len(sys.argv) > 4 else "sft"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(model_dir), dtype=torch.float32
            )
    pub = Recorder()
    tr = Trainer(
        model=model,
        algo=algorithm(algo),
        batch_source=Fixed(share(rank, world, split)),
        publisher=pub,
        cfg=config(),
    )
    sharded = sum(1 for p in tr.model.parameters() if type(p).__name__ == "DTensor")
    ref_sharded = sum(
        1 for p in getattr(tr.ref_model, "parameters", list)() if type(p).__name__ == "DTensor"
    )
    critic_sharded = 0
    if tr.critic is not None:
        critic_sharded = sum(1 for p in tr.critic.params if type(p).__name__ == "DTensor")

    async def step_and_publish() -> dict[str, float]:
        stats = await tr.train_step()
        await tr.finish_publish()  # the step's publish was sent in the background by rank 0
        return stats

    stats = asyncio.run(step_and_publish())
    sd = tr.full_state_dict()
    only0 = tr.full_state_dict(rank0_only=True)  # the publish path: only rank 0 holds it all
    rank0_only_ok = (
        (only0 == {})
        if rank != 0
        else (only0.keys() == sd.keys() and all(torch.equal(only0[k], sd[k]) for k in sd))
    )
    seen: set[int] = set()
    flat = {}
    for k, v in sd.items():  # tied embeddings share storage; safetensors wants copies
        v = v.contiguous()
        if v.untyped_storage().data_ptr() in seen:
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        flat[k] = v
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(flat, str(out_dir / f"rank{rank}.safetensors"))
    if tr.critic is not None:  # gathered whole on every rank (a collective)
        critic_sd = parallel.full_state_dict(tr.critic.model)
        save_file(
            {k: v.contiguous() for k, v in critic_sd.items()},
            str(out_dir / f"rank{rank}_critic.safetensors"),
        )
    (out_dir / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "loss": stats["loss"],
                "grad_norm": stats["grad_norm"],
                "num_items": stats["num_items"],
                "num_micro_batches": stats["num_micro_batches"],
                "policy_version": tr.policy_version,
                "publish_calls": pub.calls,
                "dtensor_params": sharded,
                "ref_dtensor_params": ref_sharded,
                "critic_dtensor_params": critic_sharded,
                "adv": [stats.get("adv_mean"), stats.get("adv_std")],
                "kl": {k: v for k, v in stats.items() if "kl" in k},
                "world": world,
                "rank0_only_ok": rank0_only_ok,
                # the tied head is one DTensor under FSDP2 too: gathered and kept once
                "tied_once": tr.model.config.tie_word_embeddings
                and "model.embed_tokens.weight" in sd
                and "lm_head.weight" not in sd,
            }
        )
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
