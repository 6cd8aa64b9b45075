"""``LudicEngine``: vLLM's AsyncLLM plus a policy version and an atomic weight swap.

Swap policy (the contract of both weight planes, see README.md): the new weights are fully
received and validated first (HTTP: by this process, staged in a file; collective: by the
vLLM workers themselves, through vLLM's weight-transfer API and the ``ludic`` engine,
services/inference/weight_transfer.py); then, under one asyncio lock,

    keep:  collective_rpc(reload)            # between two steps: every worker loads
           reset_prefix_cache(running=True)  # old-weight KV dropped, running requests recompute
           update_weight_version(N)          # vLLM labels every later output token with N
    wait:  pause_generation(mode="wait")     # admission paused; in-flight requests finish
           collective_rpc(reload); update_weight_version(N); resume_generation()

``update_mode="keep"`` (default, an in-flight weight update): no drain and no pause call.
The EngineCore runs the reload RPC between two scheduler steps, so generation stops only
for the reload; then every KV block the old weights computed is dropped (the prefix cache,
and the running requests', which are preempted and recompute theirs under the new weights)
and later tokens are labelled N. One response may hold tokens of two versions. Every token
keeps the logprob it was sampled with (the behaviour policy's), and the response's
``policy_version`` is the *oldest* version that produced any of its tokens (the conservative
age for staleness); ``policy_versions`` lists them all when there are several.
``update_mode="wait"``: requests in flight finish on the old weights first, so each request
is served by exactly one version, at the price of a pause as long as the longest request.
The version of a response is read from vLLM's per-token weight-version spans
(``CompletionOutput.weight_versions``), which a wrapper around ``AsyncLLM.generate``
collects per HTTP request through a ContextVar.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from services.inference import vllm_plugin
from services.inference.metrics import InferenceMetrics
from services.inference.settings import InferenceSettings
from services.inference.validation import ParamSpec, complete_partial
from services.inference.vllm_plugin import TRANSFER_BACKEND

log = logging.getLogger("ludic.inference")

WORKER_EXTENSION = "services.inference.worker_ext.LudicWorkerExtension"


class SwapError(RuntimeError):
    """The engine could not apply an already validated update (``status``: 503 or 500)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class VersionCollector:
    """Weight versions and token counts of the generations of one HTTP request."""

    versions: list[int] = field(default_factory=list)
    tokens: int = 0
    # False: the request's text is decoded once at the end (services/inference/token_text.py)
    detokenize: bool = True

    def add(self, output: Any, adapter_version: int | None = None) -> None:
        """``adapter_version``: the LoRA adapter the output was generated with (its
        version; the weight-version label then stays at the base weights')."""
        for comp in getattr(output, "outputs", None) or []:
            self.tokens += len(comp.token_ids or ())
            if adapter_version is not None:
                self.versions.append(adapter_version)
                continue
            for span in getattr(comp, "weight_versions", None) or []:
                if span.end > span.start:
                    self.versions.append(_as_version(span.version))

    def policy_version(self, current: int) -> tuple[int, bool]:
        """(version that produced the tokens, whether they span several versions)."""
        if not self.versions:
            return current, False
        return min(self.versions), len(set(self.versions)) > 1


COLLECTOR: contextvars.ContextVar[VersionCollector | None] = contextvars.ContextVar(
    "ludic_version_collector", default=None
)


def _as_version(label: Any) -> int:
    try:
        return int(label)
    except (TypeError, ValueError):
        return 0  # vLLM's initial label is "default": the weights loaded at start


class WeightShadow:
    """Current HF-format value of every parameter: received tensors, else the checkpoint.

    ``stale``: the served weights came over the collective plane, whose tensors never pass
    through this process, so their values are unknown here until a complete HTTP update
    (partial HTTP updates and rollbacks need them and are refused meanwhile)."""

    def __init__(self, spec: ParamSpec):
        self.spec = spec
        self.overrides: dict[str, torch.Tensor] = {}
        self.stale = False

    def get(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        if self.stale:
            raise RuntimeError("the served weights came over the collective plane: unknown here")
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Any, list[str]] = {}
        for n in names:
            if n in self.overrides:
                out[n] = self.overrides[n]
            else:
                by_file.setdefault(self.spec.files[n], []).append(n)
        for path, ns in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
        return out

    def update(self, tensors: dict[str, torch.Tensor]) -> None:
        self.overrides.update(tensors)
        if self.stale and not self.spec.missing(self.overrides):
            self.stale = False

    def forget(self) -> None:
        """The served weights changed without passing through here (the collective plane)."""
        self.overrides.clear()
        self.stale = True


def _to_payload(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})


def _stage(payload: Any, directory: str | None) -> str:
    """Write a safetensors payload to a fresh file (private to this process's user)."""
    fd, path = tempfile.mkstemp(prefix="ludic-weights-", suffix=".safetensors", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    return path


def _stage_adapter(payload: Any, config: dict[str, Any], directory: str | None) -> str:
    """A fresh peft adapter directory (``adapter_model.safetensors`` = the body as sent,
    ``adapter_config.json``) for vLLM to load; its path."""
    path = tempfile.mkdtemp(prefix="ludic-adapter-", dir=directory)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(payload)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "bias": "none", **config}, f)
    return path


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


#: the adapter ranks vLLM's --max-lora-rank takes (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: adapters kept loaded: the served one and the ones before it that requests may still use
#: (vLLM batches requests of at most --max-loras adapters together)
KEEP_ADAPTERS = 2


def lora_args(max_lora_rank: int) -> list[str]:
    """vLLM engine flags serving LoRA adapters up to ``max_lora_rank`` (0: none): the
    smallest rank vLLM takes that covers it, and room for :data:`KEEP_ADAPTERS` adapters
    in one batch (the served one and the previous one, which requests begun before an
    update still use)."""
    if max_lora_rank <= 0:
        return []
    fits = [r for r in VLLM_LORA_RANKS if r >= max_lora_rank]
    if not fits:
        raise ValueError(f"max_lora_rank={max_lora_rank}: vLLM serves ranks up to 512")
    return [
        "--enable-lora",
        "--max-lora-rank", str(fits[0]),
        "--max-loras", str(KEEP_ADAPTERS),
    ]  # fmt: skip


def platform_default_args(vllm_args: list[str], is_cpu: bool) -> list[str]:
    """The user's pass-through vLLM flags, plus our defaults for the platform.

    CPU: ``--no-enable-chunked-prefill`` unless the user chose either way. vLLM 0.32's CPU
    sampler kills the engine ("CPU Generator does not use offset") when the prefill of a
    seeded request is chunked, and every rollout request is seeded; prompts of a few
    hundred tokens (tic-tac-toe, tool transcripts) get chunked under load.
    """
    out = list(vllm_args)
    chosen = any(
        a.split("=", 1)[0] in ("--enable-chunked-prefill", "--no-enable-chunked-prefill")
        for a in out
    )
    if is_cpu and not chosen:
        out.append("--no-enable-chunked-prefill")
    return out


def idle_wait_env(settings: InferenceSettings, is_cpu: bool) -> dict[str, str]:
    """Environment for vLLM's processes read by ``services.inference.vllm_plugin``: how long
    the EngineCore and worker spin between messages (0 on CPU unless configured), and the
    longest sleep after that. Empty (vLLM's own behaviour) on GPUs unless configured."""
    spin = settings.engine_idle_spin_s
    if spin is None:
        if not is_cpu:
            return {}
        spin = 0.0
    return {
        vllm_plugin.SPIN_ENV: repr(float(spin)),
        vllm_plugin.POLL_ENV: str(int(settings.engine_idle_poll_ms)),
    }


def cpu_linear_env(settings: InferenceSettings, is_cpu: bool) -> dict[str, str]:
    """Environment for vLLM's processes read by ``services.inference.vllm_plugin``: whether
    the CPU backend keeps plain weights (``cpu_linear``: plain, or auto with float32) so a
    weight update is a copy (``worker_ext``). Empty on GPUs."""
    if not is_cpu:
        return {}
    mode = settings.cpu_linear
    plain = mode == "plain" or (mode == "auto" and settings.dtype in ("float32", "float"))
    return {vllm_plugin.PLAIN_LINEAR_ENV: "1" if plain else "0"}


WARMUP_PROMPT_TOKENS = 64


def needs_warmup(is_cpu: bool, served_dtype: torch.dtype) -> bool:
    """vLLM 0.32's CPU attention kernel for bf16 on AMX CPUs (Sapphire Rapids and later) dies
    with SIGILL when the worker's first prefill is short: a first prompt of 1 or 2 tokens
    killed the worker (our /health probe is 1 token), 7 or 34 tokens did not, and after one
    longer prefill 1-token prompts run fine. So a bf16 CPU engine runs one
    ``WARMUP_PROMPT_TOKENS``-token prefill before it serves (``LudicEngine.start``)."""
    return is_cpu and served_dtype == torch.bfloat16


async def warm_up(llm: Any, vocab_size: int, max_model_len: int) -> None:
    """One greedy 1-token generation from a ``WARMUP_PROMPT_TOKENS``-token prompt."""
    # vLLM where used: the unit tests drive LudicEngine and its helpers without loading it
    from vllm import SamplingParams

    n = max(1, min(WARMUP_PROMPT_TOKENS, max_model_len - 1))
    log.info("bf16 on CPU: one %d-token warm-up prefill before serving (see needs_warmup)", n)
    prompt = {"prompt_token_ids": [i % vocab_size for i in range(n)]}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    async for _ in llm.generate(prompt, params, request_id=f"ludic-warmup-{uuid.uuid4().hex}"):
        pass


class LudicEngine:
    """Owns the AsyncLLM, vLLM's OpenAI serving objects, the version and the update lock."""

    def __init__(
        self,
        settings: InferenceSettings,
        llm: Any,
        serving: Any,
        spec: ParamSpec,
        metrics: InferenceMetrics,
    ):
        self.settings = settings
        self.llm = llm
        self.serving = serving  # starlette State filled by vLLM's init_app_state
        self.spec = spec
        self.shadow = WeightShadow(spec)
        self.metrics = metrics
        self.version = 0
        self.last_reload_s = 0.0  # the last swap's in-place reload time in the worker
        # set when a failed reload could not be rolled back: the weights are neither the old
        # nor the new version, so the server stops (exit 1) rather than serve them
        self.broken: str | None = None
        self.lock = asyncio.Lock()
        # the LoRA adapter every generation runs with (max_lora_rank > 0), newest last: the
        # served one and the few before it, which requests started earlier may still use
        self.adapters: list[tuple[Any, str]] = []  # (vLLM LoRARequest, its staged directory)
        self._probe_at = -1e9
        self._probe_result: tuple[bool, str] = (False, "not probed yet")
        self._wrap_generate()

    # ------------------------------------------------------------------ start/stop
    @classmethod
    async def start(cls, settings: InferenceSettings, metrics: InferenceMetrics) -> LudicEngine:
        # vLLM where used (see warm_up)
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

        argv = [
            "--model", settings.model_dir,
            "--worker-extension-cls", WORKER_EXTENSION,
            "--dtype", settings.dtype,
            "--logprobs-mode", settings.logprobs_mode,
            "--seed", str(settings.seed),
            "--tensor-parallel-size", str(settings.tensor_parallel_size),
            "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
            # the collective plane: each worker a rank of the learner's weight group
            "--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND}),
        ]  # fmt: skip
        if settings.max_model_len:
            argv += ["--max-model-len", str(settings.max_model_len)]
        if settings.enforce_eager:
            argv += ["--enforce-eager"]
        if settings.served_model_name:
            argv += ["--served-model-name", settings.served_model_name]
        argv += lora_args(settings.max_lora_rank)
        from vllm.platforms import current_platform  # vLLM where used (see warm_up)

        argv += platform_default_args(list(settings.vllm_args), current_platform.is_cpu())
        # inherited by the EngineCore and worker processes vLLM spawns below
        os.environ.update(idle_wait_env(settings, current_platform.is_cpu()))
        os.environ.update(cpu_linear_env(settings, current_platform.is_cpu()))
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        llm = AsyncLLM.from_engine_args(engine_args)
        try:
            await llm.update_weight_version("0")
            state = State()
            await init_app_state(llm, state, args, await llm.get_supported_tasks())
            served_dtype = llm.model_config.dtype  # resolved to a torch.dtype by vLLM
            assert isinstance(served_dtype, torch.dtype), served_dtype
            spec = ParamSpec.from_model_dir(settings.model_dir, served_dtype=served_dtype)
            if needs_warmup(current_platform.is_cpu(), served_dtype):
                mc = llm.model_config
                await warm_up(llm, mc.get_vocab_size(), mc.max_model_len)
        except BaseException:
            llm.shutdown()
            raise
        return cls(settings, llm, state, spec, metrics)

    async def shutdown(self) -> None:
        self.llm.shutdown()
        for _, path in self.adapters:
            shutil.rmtree(path, ignore_errors=True)

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer (vLLM's own instance)."""
        return self.llm.get_tokenizer()

    # ------------------------------------------------------------------ generation
    def _wrap_generate(self) -> None:
        """Shadow ``llm.generate`` on the instance so vLLM's serving code (which calls it)
        reports each finished output to the HTTP request's VersionCollector, and runs the
        request without per-token detokenization when the collector says so."""
        original = self.llm.generate

        def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            collector = COLLECTOR.get()  # read now: the serving code calls us eagerly
            if collector is not None and not collector.detokenize:
                params = kwargs["sampling_params"] if "sampling_params" in kwargs else args[1]
                params.detokenize = False
            adapter_version = None
            if self.adapters and kwargs.get("lora_request") is None:
                # the served adapter, for the request's whole life (a later one does not
                # change it): the request's version is the adapter's
                lora = self.adapters[-1][0]
                kwargs["lora_request"], adapter_version = lora, int(lora.lora_int_id)
            agen = original(*args, **kwargs)
            if collector is None:
                return agen
            return _tracked(agen, collector, adapter_version)

        self.llm.generate = generate

    # ------------------------------------------------------------------ health
    async def probe(self) -> tuple[bool, str]:
        """Engine check + a 1-token greedy generation, cached ``health_cache_s``."""
        now = time.monotonic()
        if now - self._probe_at < self.settings.health_cache_s:
            return self._probe_result
        if self.lock.locked() and self._probe_result[0]:
            return True, "weight update in progress"
        try:
            await asyncio.wait_for(self._probe_once(), self.settings.probe_timeout_s)
            result = (True, "")
        except Exception as e:  # the probe's job is to turn any failure into a 503
            result = (False, f"{type(e).__name__}: {e}")
        self._probe_at, self._probe_result = time.monotonic(), result
        return result

    async def _probe_once(self) -> None:
        from vllm import SamplingParams  # vLLM where used (see warm_up)

        if self.llm.errored:
            raise RuntimeError("vLLM engine is dead")
        await self.llm.check_health()
        finished = False
        async for out in self.llm.generate(
            {"prompt_token_ids": [0]},
            SamplingParams(max_tokens=1, temperature=0.0),
            request_id=f"ludic-health-{uuid.uuid4().hex}",
        ):
            finished = out.finished
        if not finished:
            raise RuntimeError("probe generation did not finish")

    # ------------------------------------------------------------------ weights
    async def swap(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        payload: Any | None = None,
    ) -> float:
        """Apply validated ``tensors`` as ``version``; caller holds ``self.lock``.

        ``payload``: the same tensors already as safetensors bytes (the HTTP body), to
        avoid re-serialising. Returns the seconds admission was paused.

        The payload is serialised (when it must be) and staged in a file off the event loop
        and before any pause: the workers then read it from the page cache, and the pause
        covers the reload RPC only (``ludic_inference_weight_pause_seconds``).
        """
        assert self.lock.locked(), "swap() must run under engine.lock"
        missing = complete_partial(tensors, self.spec)
        if missing and self.shadow.stale:
            raise SwapError(
                "a partial update needs the served values of the parameters it leaves out, "
                "and the served weights came over the collective plane; send a complete "
                f"update (missing e.g. {missing[:3]})",
                422,
            )
        received = {k: v for k, v in tensors.items() if k not in self.spec.aliases}
        forwarded = self.spec.to_served(received)  # e.g. an fp32 learner -> a bf16 server
        cast = any(forwarded[k] is not received[k] for k in received)
        if missing:
            full = dict(forwarded)
            full.update(self.spec.to_served(self.shadow.get(missing)))
            payload = await asyncio.to_thread(_to_payload, full)
        elif payload is None or cast or len(forwarded) != len(tensors):
            payload = await asyncio.to_thread(_to_payload, forwarded)
        path = await asyncio.to_thread(_stage, payload, self.settings.weight_staging_dir)

        async def restore(cause: Exception) -> None:
            await self._restore(forwarded, missing, cause)

        try:
            pause_s, reload_s = await self._apply_as(
                version, lambda: self._reload(path), restore, _nothing
            )
        finally:
            await asyncio.to_thread(_unlink, path)
        self.shadow.update(forwarded)
        return self._done(version, pause_s, reload_s)

    async def _reload(self, path: str) -> float:
        """Every worker reloads the staged safetensors file ``path`` in place; the slowest
        worker's reload seconds. The EngineCore runs the RPC between two scheduler steps (no
        step runs meanwhile), so it carries the file's path, not the bytes."""
        reloads = await self.llm.collective_rpc("ludic_load_safetensors", args=(path,))
        return max((float(x) for x in reloads), default=0.0)

    async def _restore(
        self, forwarded: dict[str, torch.Tensor], missing: list[str] | None, cause: Exception
    ) -> None:
        """Reload the previous values (the shadow is only updated after a good reload). If
        that fails too, or they are unknown here (``WeightShadow.stale``), the engine is
        ``broken``."""
        path = ""
        try:
            old = self.spec.to_served(self.shadow.get(list(forwarded) + list(missing or ())))
            payload = await asyncio.to_thread(_to_payload, old)
            path = await asyncio.to_thread(_stage, payload, self.settings.weight_staging_dir)
            await self._reload(path)
        except Exception as e:
            await self._break(
                f"a weight reload failed ({cause}) and restoring v{self.version} "
                f"failed too ({type(e).__name__}: {e})",
                e,
            )
        finally:
            if path:
                await asyncio.to_thread(_unlink, path)

    async def _break(self, why: str, cause: BaseException) -> None:
        """The weights are neither the old nor the new version: stop generation; the server
        exits non-zero (its supervisor restarts it on the checkpoint; the learner
        republishes). Raises ``SwapError`` (500)."""
        self.broken = why
        log.critical("%s; stopping generation and exiting", why)
        with contextlib.suppress(Exception):
            await self.llm.pause_generation(mode="abort", clear_cache=True)
        raise SwapError(f"{why}; the server is shutting down", 500) from cause

    def _done(self, version: int, pause_s: float, reload_s: float) -> float:
        self.version = version
        self.last_reload_s = reload_s
        self.metrics.weight_pause_seconds.observe(pause_s)
        self.metrics.weight_reload_seconds.observe(reload_s)
        log.info(
            "swap v%d (update_mode %s): generation paused %.3f s, reload in the worker %.3f s",
            version,
            self.settings.update_mode,
            pause_s,
            reload_s,
        )
        return pause_s

    async def _apply_as(
        self,
        version: int,
        apply: Callable[[], Awaitable[float]],
        restore: Callable[[Exception], Awaitable[None]],
        undo: Callable[[], Awaitable[None]],
    ) -> tuple[float, float]:
        """Run ``apply`` (the reload in the workers; returns its seconds in the slowest
        worker) as ``version`` under ``update_mode``; (seconds generation paused, reload
        seconds). ``restore(cause)``: bring the previous weights back after a failed
        ``apply`` (or raise ``SwapError`` via ``_break``); ``undo``: drop what was staged
        when a drain timed out (nothing changed).

        keep: reload between two steps, then drop every KV block computed by the old
        weights (the prefix cache, and the running requests', which are preempted and
        recompute theirs under the new weights), then label later tokens ``version``.
        Generation pauses only for the reload. A step that runs between the reload and the
        new label is labelled with the previous version: older than it is, never newer.

        wait: new requests queue, running ones finish on the old weights, then reload,
        relabel and resume: each request is served by exactly one version."""
        t0 = time.monotonic()
        if self.settings.update_mode == "keep":
            try:
                reload_s = await apply()
            except Exception as e:
                await restore(e)
                raise SwapError(f"reload failed, previous weights restored: {e}") from e
            pause_s = time.monotonic() - t0
            await self.llm.reset_prefix_cache(reset_running_requests=True)
            await self.llm.update_weight_version(str(version))
            return pause_s, reload_s
        try:
            await asyncio.wait_for(
                self.llm.pause_generation(mode="wait", clear_cache=True),
                self.settings.drain_timeout_s,
            )
        except TimeoutError as e:
            await self.llm.resume_generation()
            await undo()
            raise SwapError(
                f"in-flight requests did not drain within {self.settings.drain_timeout_s} s; "
                "nothing changed, retry later or raise --drain-timeout-s",
                503,
            ) from e
        try:
            reload_s = await apply()
            await self.llm.update_weight_version(str(version))
        except Exception as e:
            await restore(e)  # raises (and stays paused) if it fails
            await self.llm.resume_generation()
            raise SwapError(f"reload failed, previous weights restored: {e}") from e
        await self.llm.resume_generation()
        return time.monotonic() - t0, reload_s

    # ------------------------------------------------------------------ LoRA adapters
    async def swap_adapter(self, version: int, payload: Any, config: dict[str, Any]) -> float:
        """Serve a validated LoRA adapter (``payload``: its safetensors body, peft names;
        ``config``: its peft config) as ``version``; caller holds ``self.lock``. Returns
        the seconds generation was paused: none (0.0).

        The adapter is staged as a peft directory and loaded into every worker
        (``AsyncLLM.add_lora``) while generation goes on; then later requests run with it
        (``lora_request`` set by the ``generate`` wrapper) and are labelled ``version``,
        while requests begun earlier finish with the adapter they started with (each
        response is served by exactly one version, as under ``update_mode=wait``, with no
        pause). Adapters older than the last :data:`KEEP_ADAPTERS` are unloaded."""
        from vllm.lora.request import LoRARequest  # vLLM where used (see warm_up)

        assert self.lock.locked(), "swap_adapter() must run under engine.lock"
        path = await asyncio.to_thread(
            _stage_adapter, payload, config, self.settings.weight_staging_dir
        )
        lora = LoRARequest(f"ludic-v{version}", version, path)
        t0 = time.monotonic()
        try:
            await self.llm.add_lora(lora)
        except Exception as e:  # vLLM refused the adapter: nothing changed
            await asyncio.to_thread(shutil.rmtree, path, True)
            raise SwapError(f"vLLM did not load the adapter: {type(e).__name__}: {e}", 422) from e
        self.adapters.append((lora, path))  # from here on, new requests run with it
        paused = self._done(version, 0.0, time.monotonic() - t0)
        while len(self.adapters) > KEEP_ADAPTERS:
            old, old_path = self.adapters.pop(0)
            with contextlib.suppress(Exception):  # already evicted by vLLM: nothing to drop
                await self.llm.remove_lora(old.lora_int_id)
            await asyncio.to_thread(shutil.rmtree, old_path, True)
        return paused

    # ------------------------------------------------------------------ collective plane
    @property
    def transfer_workers(self) -> int:
        """vLLM workers of this replica; each is a rank of the learner's weight group."""
        pc = self.llm.vllm_config.parallel_config
        return int(pc.world_size) * int(pc.data_parallel_size)

    @property
    def transfer_backends(self) -> tuple[str, ...]:
        """Group backends the workers can join: nccl needs CUDA workers."""
        from vllm.platforms import current_platform  # vLLM where used (see warm_up)

        return ("gloo", "nccl") if current_platform.is_cuda() else ("gloo",)

    async def transfer_init(self, init_info: dict[str, Any]) -> None:
        """Every worker starts joining the group (services/inference/weight_transfer.py)."""
        from vllm.distributed.weight_transfer.base import (  # vLLM where used (see warm_up)
            WeightTransferInitRequest,
        )

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info))

    async def _transfer_phase(self, phase: str, rnd: int, **meta: Any) -> None:
        from vllm.distributed.weight_transfer.base import (  # vLLM where used (see warm_up)
            WeightTransferUpdateRequest,
        )

        info = {"phase": phase, "round": rnd, **meta}
        await self.llm.update_weights(WeightTransferUpdateRequest(info))

    async def transfer_receive(self, rnd: int, meta: dict[str, Any]) -> None:
        """Every worker starts receiving round ``rnd`` in a thread (two short RPCs); the
        broadcast then runs while generation goes on. Caller holds ``self.lock``."""
        assert self.lock.locked(), "transfer_receive() must run under engine.lock"
        await self.llm.start_weight_update()
        await self._transfer_phase("recv", rnd, **meta)

    async def transfer_discard(self, rnd: int) -> None:
        """Drop round ``rnd`` in every worker and close the update (nothing changed)."""
        await self._transfer_phase("discard", rnd)
        await self.llm.finish_weight_update()

    async def transfer_swap(
        self, version: int, rnd: int, reload_seconds: Callable[[], Awaitable[float]]
    ) -> float:
        """Load received round ``rnd`` as ``version`` under ``update_mode`` (one RPC: the
        pause); caller holds ``self.lock``. ``reload_seconds()``: the slowest worker's load
        time (from the group's store). A failed load cannot be rolled back (the old values
        are in no process): the engine is ``broken``. Returns the seconds paused."""
        assert self.lock.locked(), "transfer_swap() must run under engine.lock"

        async def apply() -> float:
            await self._transfer_phase("apply", rnd)
            return 0.0  # read from the store once generation runs again

        async def restore(cause: Exception) -> None:
            await self._break(
                f"loading collective round {rnd} as v{version} failed ({cause}); the "
                "previous weights are in no process to restore",
                cause,
            )

        pause_s, _ = await self._apply_as(
            version, apply, restore, lambda: self.transfer_discard(rnd)
        )
        self.shadow.forget()
        await self.llm.finish_weight_update()  # closes vLLM's update session; loads nothing
        return self._done(version, pause_s, await reload_seconds())


async def _nothing() -> None:
    return None


async def _tracked(
    agen: AsyncIterator[Any], collector: VersionCollector, adapter_version: int | None = None
) -> AsyncIterator[Any]:
    async for out in agen:
        if out.finished:
            collector.add(out, adapter_version)
        yield out
