"""vLLM general plugin (entry point ``vllm.general_plugins: ludic``): idle waits that sleep.

vLLM loads general plugins in every process it starts (API server, EngineCore, workers).
This one acts only when ``LUDIC_VLLM_BUSY_LOOP_S`` is set, which ``ludic inference`` does
(``engine.idle_wait_env``, from the ``engine_idle_spin_s`` / ``engine_idle_poll_ms``
settings); anything else using vLLM in the same environment is left alone.

Why: vLLM 0.32's shared-memory message queue between the EngineCore and its worker process
busy-loops (``sched_yield``) for ``SpinCondition.busy_loop_s`` = 1 s after every read before
it sleeps on a notification socket. A GPU box has host cores to spare for that; on a small
CPU machine the two spinning processes take the cores the API server, the actors and the
learner need. Measured on a 2-core machine serving 64 concurrent 8-token chat completions
(86% of the worker's samples in the spin loop, 3% in the model): 54 samples/s with the spin,
219 with ``busy_loop_s = 0`` and the socket wait capped at 20 ms.

The cap: with no spin at all, vLLM's reader sometimes misses the writer's notification
(a ZMQ PUB socket with a high-water mark of 1 feeding a CONFLATE subscriber) and sleeps for
its full 5 s recheck interval; capping each wait at ``LUDIC_VLLM_POLL_MS`` bounds that to a
few milliseconds at a cost of ~50 wake-ups a second while idle.
"""

from __future__ import annotations

import os
from typing import Any

SPIN_ENV = "LUDIC_VLLM_BUSY_LOOP_S"
POLL_ENV = "LUDIC_VLLM_POLL_MS"


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
    """(spin seconds, wait cap in ms; 0 = uncapped), or None when the plugin is off."""
    spin = _number(SPIN_ENV, float, "0")
    if spin is None:
        return None
    poll = _number(POLL_ENV, int, "20")
    return spin, int(poll or 0)


def register() -> None:
    """vLLM calls this in each of its processes (possibly more than once)."""
    conf = settings()
    if conf is None:
        return
    try:
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
