"""torchrun worker for test_fsdp2_cuda.py: one FSDP2 train step on CUDA over NCCL in bf16.

    python -m torch.distributed.run --standalone --nproc_per_node N fsdp2_cuda_worker.py MODEL_DIR OUT_DIR

The learner's code path: ``parallel.init_distributed`` (NCCL, the rank's GPU), rank 0 loads
the weights and the other ranks pass the architecture on the meta device, and the Trainer
(``model_device="cuda"``, ``mixed_precision_dtype="bf16"``) shards with FSDP2's
MixedPrecisionPolicy: bf16 parameters in the forward and backward, fp32 master weights and
gradient reduction. Rank r trains its share of fsdp2_worker.fixed_items (items[r::N]) with
GRPO plus a KL term (a frozen, sharded reference), then writes OUT_DIR/rank{r}.json (backend,
devices, dtypes, step stats) and OUT_DIR/rank{r}.safetensors (the gathered weights).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from fsdp2_worker import Fixed, algorithm, share  # noqa: E402

from libludic.models.tiny import PAD_ID  # noqa: E402
from libludic.training import parallel  # noqa: E402
from libludic.training.config import TrainerConfig  # noqa: E402
from libludic.training.trainer import Trainer  # noqa: E402


def config() -> TrainerConfig:
    return TrainerConfig(
        model_device="cuda",
        mixed_precision_dtype="bf16",
        lr=1e-2,
        pad_token_id=PAD_ID,
        micro_token_budget=24,
    )


def main() -> int:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    parallel.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(model_dir), dtype=torch.float32
            )
    tr = Trainer(
        model=model,
        algo=algorithm("kl"),
        batch_source=Fixed(share(rank, world, "even")),
        cfg=config(),
    )
    compute: set[str] = set()
    proj = parallel.decoder_layers(tr.model)[0].self_attn.q_proj
    proj.register_forward_pre_hook(lambda m, a: compute.add(str(m.weight.dtype)))
    stats = asyncio.run(tr.train_step())
    sd = tr.full_state_dict()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous().clone() for k, v in sd.items()},
        str(out_dir / f"rank{rank}.safetensors"),
    )
    (out_dir / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "backend": dist.get_backend(),
                "world": world,
                "device": str(tr.device),
                "param_devices": sorted({str(p.device) for p in tr.model.parameters()}),
                "master_dtypes": sorted({str(p.dtype) for p in tr.model.parameters()}),
                "compute_dtypes": sorted(compute),
                "dtensor_params": sum(
                    1 for p in tr.model.parameters() if type(p).__name__ == "DTensor"
                ),
                "loss": stats["loss"],
                "grad_norm": stats["grad_norm"],
                "kl": stats["loss/kl/kl"],
            }
        )
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
