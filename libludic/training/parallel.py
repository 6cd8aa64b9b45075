"""Device, LoRA and FSDP2 plumbing for the Trainer (kept apart so trainer.py reads as a loop).

FSDP2: when ``torch.distributed`` is initialised the model is sharded with
``torch.distributed.fsdp.fully_shard``, one call per decoder layer, then one on the root
(which then owns the embeddings, final norm and the tied LM head). gloo works on CPU, NCCL
on GPU. Gradients are *averaged* over ranks by FSDP's reduce-scatter.

Memory that scales with ranks (``shard_from_rank0``): no rank builds the full model on its
device. Every rank shards a copy of the architecture on the meta device (no storage), gives
its shards storage on the device, and fills them from rank 0's weights, broadcast one tensor
at a time (``set_model_state_dict`` with ``full_state_dict`` and ``broadcast_from_rank0``);
buffers outside the state dict (RoPE's ``inv_freq``) are broadcast from rank 0 the same way.
Only rank 0's weights are read: the other ranks may pass the model on the meta device
(``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``, as the learner does), so
the full model is held once, in rank 0's host memory, while the shards are filled. Per rank
on the device: 1/N of the model (and 1/N of the reference's), plus one full tensor in flight.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from libludic.distributed.weight_sync import PEFT_PREFIX
from libludic.training.config import TrainerConfig
from libludic.training.model_api import is_peft

log = logging.getLogger(__name__)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def init_distributed() -> None:
    """Join the torchrun process group if not already in one: NCCL with CUDA, gloo without."""
    if is_distributed():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def broadcast_json(obj: Any, device: torch.device) -> Any:
    """Rank 0's ``obj`` (JSON-able) on every rank; the others' ``obj`` is ignored.
    Collective: two broadcasts on ``device`` (the process group's: CPU for gloo, the rank's
    GPU for NCCL), the length then the UTF-8 bytes."""
    data = json.dumps(obj).encode() if rank() == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(n, src=0)
    if rank() == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().numpy()).decode())


def resolve_device(name: str) -> torch.device:
    """``name`` as a torch.device; "cuda" without CUDA falls back to CPU with a warning.

    Under torchrun, a bare "cuda" means ``cuda:{LOCAL_RANK}``.
    """
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            warnings.warn(
                f"TrainerConfig.model_device={name!r} but CUDA is not available; training on "
                "CPU (set model_device='cpu' to silence this)",
                stacklevel=3,
            )
            return torch.device("cpu")
        if dev.index is None and is_distributed():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def apply_lora(model: nn.Module, cfg: TrainerConfig) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters when ``cfg.lora_rank`` is set."""
    if cfg.lora_rank is None:
        return model
    try:
        from peft import LoraConfig, get_peft_model  # optional: the lora extra
    except ImportError as e:  # pragma: no cover - peft is in the dev/lora extras
        raise ImportError("TrainerConfig.lora_rank needs peft: pip install 'libludic[lora]'") from e
    lcfg = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
        bias="none",
    )
    return get_peft_model(model, lcfg)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the HF ``_no_split_modules`` classes."""
    base = model.get_base_model() if is_peft(model) else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [
        m
        for m in model.modules()
        if type(m).__name__ in names or type(m).__name__.endswith("DecoderLayer")
    ]
    return layers


def apply_fsdp2(model: nn.Module, mp_dtype: torch.dtype | None = None) -> nn.Module:
    kw: dict[str, Any] = {}
    if mp_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    if not layers:
        log.warning(
            "no decoder layers found in %s; sharding the root module only", type(model).__name__
        )
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no storage):
    the architecture, its attributes and hooks, tied parameters still tied (one meta
    tensor per original tensor)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            m = t.detach().to("meta")
            memo[id(t)] = nn.Parameter(m, t.requires_grad) if isinstance(t, nn.Parameter) else m
    return copy.deepcopy(model, memo)


def shard_from_rank0(
    model: nn.Module, device: torch.device, mp_dtype: torch.dtype | None = None
) -> nn.Module:
    """``model``'s architecture sharded by FSDP2 on ``device``, holding rank 0's weights
    (module docstring, "Memory that scales"); a new module: ``model`` is left as it was.

    Collective: every rank calls it with the same architecture; rank 0's ``model`` holds
    the weights (on any device), the others' may be on the meta device."""
    # torch.distributed.checkpoint takes ~0.6 s to import: only a sharded learner needs it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    persistent = set(model.state_dict().keys())
    loose = [n for n, _ in model.named_buffers() if n not in persistent]
    full = model.state_dict() if rank() == 0 else {}  # views of rank 0's tensors, no copy
    own_buffers = dict(model.named_buffers()) if rank() == 0 else {}
    shell = meta_copy(model)
    apply_fsdp2(shell, mp_dtype)
    shell.to_empty(device=device)
    set_model_state_dict(
        shell,
        full,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
    buffers = dict(shell.named_buffers())
    for name in loose:  # not in the state dict: from rank 0 as well
        if rank() == 0:
            buffers[name].copy_(own_buffers[name])
        dist.broadcast(buffers[name], src=0)
    return shell


def full_tensor(t: Any) -> torch.Tensor:
    """A DTensor (an FSDP2 shard) gathered whole (collective); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(
    model: nn.Module, to_cpu: bool = True, rank0_only: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters and buffers under their HF names.

    FSDP2 shards are all-gathered (every rank must call this). For a peft LoRA model the
    adapters are merged on the fly, W' = W + get_delta_weight(), without touching the
    live model; LoRA tensors are left out and ``.base_layer`` dropped from names.
    ``rank0_only``: the other ranks take part in each gather and drop its result at once
    (they return {}), so only rank 0 ever holds the whole model; with ``to_cpu`` each
    tensor moves to the host as soon as it is gathered (one full tensor at a time on the
    device, not the whole model).

    A tied parameter appears once, under its first name (``tie_word_embeddings``:
    ``model.embed_tokens.weight``, not ``lm_head.weight``), as Hugging Face saves it:
    vLLM and ``from_pretrained`` tie the second name themselves, and the copy would be
    gathered, held and sent again (113 MB of SmolLM2-135M's 651 MB in fp32).
    """
    keep = not rank0_only or rank() == 0

    def put(name: str, t: torch.Tensor) -> None:
        if keep:
            out[name] = t.to("cpu") if to_cpu else t

    def untied(sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for name, t in sd.items():  # keep_vars: a tied parameter is one object
            if id(t) not in seen:
                seen.add(id(t))
                yield name, t

    out: dict[str, torch.Tensor] = {}
    if is_peft(model):
        from peft.tuners.lora import LoraLayer  # optional (lora extra): a peft model has it

        base = model.get_base_model()
        for name, t in untied(base.state_dict(keep_vars=True)):
            if "lora_" in name:
                continue
            put(name.replace(".base_layer.", "."), full_tensor(t).detach())
        for mname, mod in base.named_modules():
            if isinstance(mod, LoraLayer):
                w = full_tensor(mod.get_base_layer().weight).detach()
                for a in mod.active_adapters:
                    if a in mod.lora_A:
                        w = w + full_tensor(mod.get_delta_weight(a)).detach()  # type: ignore[attr-defined]
                put(f"{mname}.weight", w)
    else:
        for name, t in untied(model.state_dict(keep_vars=True)):
            put(name, full_tensor(t).detach())
    return out


def adapter_config(cfg: TrainerConfig) -> dict[str, Any]:
    """The LoRA adapter's peft ``adapter_config.json`` fields that fix its maths: a replica
    serves ``W + (lora_alpha / r) * B @ A`` on every ``target_modules`` linear."""
    if cfg.lora_rank is None:
        raise ValueError("adapter_config needs TrainerConfig.lora_rank")
    return {
        "peft_type": "LORA",
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "target_modules": list(cfg.lora_target_modules),
        "bias": "none",
    }


def adapter_state_dict(
    model: nn.Module, to_cpu: bool = True, rank0_only: bool = False
) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a peft model alone, as peft saves them:
    ``base_model.model.<module>.lora_A.weight`` ``# [r, in]`` and ``.lora_B.weight``
    ``# [out, r]`` of the active adapter (one). FSDP2 shards are all-gathered (every rank
    must call this); ``rank0_only`` and ``to_cpu`` as in :func:`full_state_dict`."""
    if not is_peft(model):
        raise ValueError("adapter_state_dict needs a peft LoRA model (TrainerConfig.lora_rank)")
    from peft.tuners.lora import LoraLayer  # optional (lora extra): a peft model has it

    keep = not rank0_only or rank() == 0
    out: dict[str, torch.Tensor] = {}
    base = model.get_base_model()
    for mname, mod in base.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        (a,) = [x for x in mod.active_adapters if x in mod.lora_A]
        for part, layers in (("lora_A", mod.lora_A), ("lora_B", mod.lora_B)):
            t = full_tensor(layers[a].weight).detach()
            if keep:
                out[f"{PEFT_PREFIX}{mname}.{part}.weight"] = t.to("cpu") if to_cpu else t
    return out
