"""vLLM general plugin (entry point ``vllm.general_plugins: ludic``): idle waits that sleep,
plain CPU linear layers, and the ``ludic`` weight-transfer engine.

vLLM loads general plugins in every process it starts (API server, EngineCore, workers).
The weight-transfer engine (services/inference/weight_transfer.py) is put in vLLM's registry
in each of them: it is only a name there until an engine is started with
``--weight-transfer-config '{"backend": "ludic"}'``, which ``ludic inference`` does. The idle
waits act only when ``LUDIC_VLLM_BUSY_LOOP_S`` is set, which ``ludic inference`` does
(``engine.idle_wait_env``, from the ``engine_idle_spin_s`` / ``engine_idle_poll_ms``
settings); anything else using vLLM in the same environment is left alone.

Why: vLLM 0.32's shared-memory message queue between the EngineCore and its worker process
busy-loops (``sched_yield``) for ``SpinCondition.busy_loop_s`` = 1 s after every read before
it sleeps on a notification socket. A GPU box has host cores to spare for that; on a small
CPU machine the two spinning processes take the cores the API server, the actors and the
learner need (DEVELOPERS.md has the figures).

The plugin sets the spin to ``LUDIC_VLLM_BUSY_LOOP_S`` and caps each wait at
``LUDIC_VLLM_POLL_MS`` (:func:`settings`: why the cap).

Plain linear layers on the CPU (``LUDIC_VLLM_CPU_PLAIN_LINEAR=1``, which ``ludic inference``
sets for ``cpu_linear: plain``, and for ``auto`` with float32): vLLM's CPU backend replaces
each linear layer's weight with a oneDNN-packed copy at load time
(``dispatch_cpu_unquantized_gemm``), so every weight update has to go through vLLM's
layerwise reload, which rebuilds the layer's parameters and packs each weight again. With the
plugin, a 2-D weight stays as it is and the layer multiplies with ``torch.nn.functional.linear``;
an update is then a copy into those tensors (``worker_ext.LudicWorkerExtension``), with
generation as fast as packed for small models (DEVELOPERS.md has the figures). Other layers (3-D MoE or conv weights) keep vLLM's dispatch.
"""

from __future__ import annotations

import os
from typing import Any

#: the weight-transfer engine's name in vLLM's registry (``--weight-transfer-config``)
TRANSFER_BACKEND = "ludic"
TRANSFER_ENGINE = ("services.inference.weight_transfer", "LudicTransferEngine")
SPIN_ENV = "LUDIC_VLLM_BUSY_LOOP_S"
POLL_ENV = "LUDIC_VLLM_POLL_MS"
PLAIN_LINEAR_ENV = "LUDIC_VLLM_CPU_PLAIN_LINEAR"


def _number(env: str, kind: type, example: str) -> Any:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError as e:
        raise ValueError(f"{env}={raw!r} is not a number (e.g. {example})") from e
    if value < 0:
        raise ValueError(f"{env}={raw!r} must be >= 0")
    return value


def settings() -> tuple[float, int] | None:
    """(spin seconds, wait cap in ms; 0 = uncapped), or None when the plugin is off.

    The cap: with no spin at all, vLLM's reader sometimes misses the writer's notification
    (a ZMQ PUB socket with a high-water mark of 1 feeding a CONFLATE subscriber) and sleeps
    for its full 5 s recheck interval; capping each wait at ``LUDIC_VLLM_POLL_MS`` bounds
    that to a few milliseconds at a cost of ~50 wake-ups a second while idle."""
    spin = _number(SPIN_ENV, float, "0")
    if spin is None:
        return None
    poll = _number(POLL_ENV, int, "20")
    return spin, int(poll or 0)


def plain_linear(x: Any, weight: Any, bias: Any) -> Any:
    """A layer's ``cpu_linear`` under the plugin: the layer's own weight, read at each call."""
    import torch  # vLLM imports this plugin in every process: torch and vLLM only once active

    return torch.nn.functional.linear(x, weight, bias)


def uses_plain_linear(module: Any) -> bool:
    """Whether a layer multiplies by its own weight tensor (so a copy into it is an update)."""
    return getattr(module, "cpu_linear", None) is plain_linear


def _patch_cpu_linear() -> None:
    try:  # vLLM's modules once the plugin is active (see plain_linear); absent in old vLLMs
        from vllm.model_executor.layers import utils
    except ImportError:
        return
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or getattr(original, "_ludic_plain", False):
        return

    def dispatch(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            original(layer, remove_weight)
            return
        layer.cpu_linear = plain_linear  # the weight is kept: remove_weight is ignored

    dispatch._ludic_plain = True  # type: ignore[attr-defined]
    dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch


def register_transfer_engine() -> None:
    """Put the ``ludic`` weight-transfer engine in vLLM's registry (lazily: its module is
    imported only where a worker builds it). Idempotent."""
    try:  # vLLM's modules in a plugin vLLM loads in every process: imported where used
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight-transfer engines
        return
    try:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, *TRANSFER_ENGINE)
    except ValueError:  # already registered in this process
        pass


def register() -> None:
    """vLLM calls this in each of its processes (possibly more than once)."""
    register_transfer_engine()
    if os.environ.get(PLAIN_LINEAR_ENV) == "1":
        _patch_cpu_linear()
    conf = settings()
    if conf is None:
        return
    try:  # vLLM's modules once the plugin is active (see plain_linear)
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # a vLLM without the shared-memory queue: nothing to bound
        return
    cond = getattr(shm_broadcast, "SpinCondition", None)
    if cond is None:
        return
    if getattr(cond, "_ludic_idle_wait", None) is not None:
        cond._ludic_idle_wait = conf  # already patched in this process: just update
        return
    original_wait = cond.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        spin, cap = cond._ludic_idle_wait
        if self.is_reader:
            # set on every call: queues built before vLLM loaded the plugin are covered too
            self.busy_loop_s = spin
            if cap > 0:
                timeout_ms = cap if timeout_ms is None else min(timeout_ms, cap)
        original_wait(self, timeout_ms)

    cond._ludic_idle_wait = conf
    cond.wait = wait
