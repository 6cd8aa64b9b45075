"""vLLM worker extension: in-place reload of HF-named weights (safetensors bytes or file).

Mixed into every vLLM worker via ``worker_extension_cls``; called through
``AsyncLLM.collective_rpc("ludic_load_safetensors", args=(payload,))``. Bytes (not tensors
in lists) are what survives the RPC serialisation, and ``reload_weights`` (not a bare
``model.load_weights``) redoes the backend's weight post-processing, which the CPU backend
needs, except where every layer keeps its plain weight (``copy_reload_applies``: the
``vllm_plugin``'s plain CPU linear layers, unquantized): then an update is
``model.load_weights``, a copy, about 8x faster for the demo's model.

Tied parameters (``tie_word_embeddings``: ``lm_head.weight`` *is* ``embed_tokens.weight``):
vLLM's layerwise reload post-processes only the layers whose weights it loaded. The tied
head loads nothing (the checkpoint has no ``lm_head.weight``), so its kernel state built at
start-up is kept. On the CPU backend that state is a packed copy of the weight
(``dispatch_cpu_unquantized_gemm`` -> ``layer.cpu_linear`` closes over a oneDNN handle or an
sgl-packed tensor), so after an update the head kept multiplying by the *old* embedding
(served logprobs off by 0.1-0.4 nats). ``ludic_load_safetensors`` therefore re-runs the
post-processing of every layer that shares a parameter with another layer after each reload.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from safetensors.torch import load, load_file

from services.inference.vllm_plugin import uses_plain_linear


def shared_parameter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules holding (directly) a parameter that another module also holds (tied weights)."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(module)
    out: list[torch.nn.Module] = []
    for mods in holders.values():
        if len(mods) > 1:
            out.extend(m for m in mods if not any(m is o for o in out))
    return out


@torch.no_grad()
def refresh_tied_kernels(model: torch.nn.Module) -> int:
    """Redo the CPU GEMM dispatch of tied layers; return how many were redone.

    Only layers with a ``cpu_linear`` (the CPU backend's packed copy) are touched: on other
    platforms an unquantized head multiplies by ``layer.weight`` itself, which the reload
    already updated in place.
    """
    n = 0
    for layer in shared_parameter_layers(model):
        method = getattr(layer, "quant_method", None)
        if hasattr(layer, "cpu_linear") and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(layer)  # type: ignore[union-attr]
            n += 1
    return n


def copy_reload_applies(model: torch.nn.Module, vllm_config: Any) -> bool:
    """Whether an update can be the model's own ``load_weights`` (a copy into the served
    tensors, through each parameter's loader: stacked q/k/v and gate/up included) with no
    post-processing: no quantization, no quantized KV cache, and every layer with a CPU
    kernel multiplying by its own weight (``vllm_plugin`` plain linear layers; tied weights
    are then one tensor). Otherwise vLLM's layerwise ``reload_weights`` redoes the
    post-processing."""
    if getattr(vllm_config.model_config, "quantization", None) is not None:
        return False
    if str(getattr(vllm_config.cache_config, "cache_dtype", "auto")) != "auto":
        return False
    kernels = [m for m in model.modules() if hasattr(m, "cpu_linear")]
    return bool(kernels) and all(uses_plain_linear(m) for m in kernels)


def load_in_place(
    model: torch.nn.Module,
    vllm_config: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    reload: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
) -> None:
    """Load HF-named ``weights`` into the served ``model``: a copy through the model's own
    ``load_weights`` where :func:`copy_reload_applies`, else ``reload`` (vLLM's layerwise
    reload, which redoes the backend's post-processing) and the tied layers' kernels. Both
    weight planes end here (``ludic_load_safetensors``; the ``ludic`` weight-transfer
    engine, services/inference/weight_transfer.py)."""
    if copy_reload_applies(model, vllm_config):
        with torch.no_grad():
            model.load_weights(iter(weights))  # type: ignore[operator]
    else:
        reload(iter(weights))
        refresh_tied_kernels(model)


class LudicWorkerExtension:
    def ludic_load_safetensors(self, payload: Any) -> float:
        """Reload the tensors of ``payload`` in place: safetensors bytes, or the path of a
        safetensors file the API server staged (a path keeps the bytes out of the RPC, which
        the EngineCore serves between two steps: generation waits for it). Returns the
        seconds it took in this worker (the in-place reload time the swap's pause is
        measured against)."""
        t0 = time.perf_counter()
        tensors = load_file(payload) if isinstance(payload, str) else load(bytes(payload))
        load_in_place(
            self.model_runner.get_model(),  # type: ignore[attr-defined]
            self.vllm_config,  # type: ignore[attr-defined]
            tensors.items(),
            lambda it: self.reload_weights(weights_iterator=it),  # type: ignore[attr-defined]
        )
        return time.perf_counter() - t0
