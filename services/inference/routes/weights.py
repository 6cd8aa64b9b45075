"""Weight routes of ``ludic inference``: ``POST /v1/weights`` (full weights, safetensors),
``POST /v1/adapter`` (a LoRA adapter) and the collective plane (``/v1/weights/collective``:
info, init, update). Every update is authorised (the weight token), validated against the
served model before it is applied, applied under the engine's lock as a version greater
than the served one (409 otherwise), and acknowledged with the version it serves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from libludic.distributed.weight_sync import ABORTED, ACK_OK, ADAPTER_ROUTE, REJECTED, WIRE_DTYPES
from services.inference.access import Access
from services.inference.context import (
    MAX_CONTROL_BODY_BYTES,
    MAX_POLICY_VERSION,
    AppContext,
    http_error,
    invalid_body,
    read_body_once,
    versioned,
)
from services.inference.schemas import (
    CollectiveInfoResponse,
    CollectiveInitRequest,
    CollectiveInitResponse,
    CollectiveUpdateRequest,
)
from services.inference.validation import (
    WeightValidationError,
    decode_adapter,
    decode_and_validate,
)
from services.inference.worker import SwapError

log = logging.getLogger("ludic.inference")


def weight_routes(ctx: AppContext, access: Access) -> APIRouter:
    router = APIRouter()
    settings, metrics, eng, plane = ctx.settings, ctx.metrics, ctx.eng, ctx.plane
    authorize = access.authorize

    def _outcome(plane: str, outcome: str) -> None:
        metrics.weight_updates.labels(plane, outcome).inc()

    async def _apply(
        e: Any, plane_name: str, version: int, swap: Awaitable[float], t0: float
    ) -> JSONResponse:
        """Caller holds e.lock and has validated everything; ``swap`` applies the update."""
        try:
            pause_s = await swap
        except SwapError as exc:
            _outcome(plane_name, "rejected" if exc.status == 422 else "error")
            raise http_error(exc.status, str(exc)) from exc
        _outcome(plane_name, "ok")
        metrics.policy_version.set(version)
        metrics.weight_update_seconds.labels(plane_name).observe(time.monotonic() - t0)
        log.info(
            "policy_version=%d via %s: %.3f s total, admission paused %.3f s",
            version,
            plane_name,
            time.monotonic() - t0,
            pause_s,
        )
        reload_s = float(getattr(e, "last_reload_s", 0.0))
        return versioned(
            {
                "policy_version": version,
                "pause_s": round(pause_s, 6),
                "reload_s": round(reload_s, 6),
            },
            version,
        )

    def _conflict(e: Any, plane: str, version: int) -> HTTPException:
        _outcome(plane, "conflict")
        return http_error(
            409,
            f"version {version} is not greater than the served policy_version {e.version}; "
            "send a larger version",
        )

    @router.post("/v1/weights", dependencies=[Depends(authorize)])
    async def post_weights(
        request: Request, version: int = Query(..., ge=0, le=MAX_POLICY_VERSION)
    ) -> JSONResponse:
        t0 = time.monotonic()
        e = eng()
        if settings.max_lora_rank > 0:
            _outcome("http", "rejected")
            raise http_error(
                400,
                f"this server serves LoRA adapters (max_lora_rank={settings.max_lora_rank}) "
                "over its checkpoint's weights: publish adapters to /v1/adapter (learner "
                "lora_publish: adapter), or restart it with max_lora_rank 0 for full weights",
            )
        if version <= e.version:  # cheap refusal before reading a large body
            raise _conflict(e, "http", version)
        buf = await read_body_once(request, settings.max_weight_bytes, "max_weight_bytes")
        metrics.weight_bytes.labels("http").inc(len(buf))
        t_read = time.monotonic()
        try:
            tensors = await asyncio.to_thread(decode_and_validate, buf, e.spec)
        except WeightValidationError as exc:
            _outcome("http", "rejected")
            raise http_error(exc.status, str(exc)) from exc
        log.info(
            "weights v%d: %d bytes read in %.3f s, validated in %.3f s",
            version,
            len(buf),
            t_read - t0,
            time.monotonic() - t_read,
        )
        async with e.lock:
            if version <= e.version:
                raise _conflict(e, "http", version)
            return await _apply(e, "http", version, e.swap(version, tensors, buf), t0)

    @router.post(ADAPTER_ROUTE, dependencies=[Depends(authorize)])
    async def post_adapter(
        request: Request, version: int = Query(..., ge=1, le=MAX_POLICY_VERSION)
    ) -> JSONResponse:
        """A LoRA adapter (safetensors, peft names, its config in the metadata:
        validation.decode_adapter) served as ``version`` over the checkpoint's weights."""
        t0 = time.monotonic()
        e = eng()
        if settings.max_lora_rank <= 0:
            _outcome("adapter", "rejected")
            raise http_error(
                400,
                "this server does not serve LoRA adapters: restart it with max_lora_rank >= "
                "the learner's lora_rank, or publish merged weights (learner lora_publish: "
                "merged) to /v1/weights",
            )
        if version <= e.version:
            raise _conflict(e, "adapter", version)
        buf = await read_body_once(request, settings.max_weight_bytes, "max_weight_bytes")
        metrics.weight_bytes.labels("adapter").inc(len(buf))
        try:
            _, config = await asyncio.to_thread(decode_adapter, buf, e.spec, settings.max_lora_rank)
        except WeightValidationError as exc:
            _outcome("adapter", "rejected")
            raise http_error(exc.status, str(exc)) from exc
        async with e.lock:
            if version <= e.version:
                raise _conflict(e, "adapter", version)
            return await _apply(e, "adapter", version, e.swap_adapter(version, buf, config), t0)

    # ------------------------------------------------------------------ weights (collective)
    @router.get("/v1/weights/collective", dependencies=[Depends(authorize)])
    async def collective_info() -> JSONResponse:
        e = eng()
        body = CollectiveInfoResponse(
            workers=int(e.transfer_workers), backends=list(e.transfer_backends)
        )
        return JSONResponse(body.model_dump())

    @router.post("/v1/weights/collective/init", dependencies=[Depends(authorize)])
    async def collective_init(request: Request) -> JSONResponse:
        # parsed here, after authorize: an unauthenticated body is never read
        raw = await read_body_once(request, MAX_CONTROL_BODY_BYTES)
        try:
            req = CollectiveInitRequest.model_validate_json(bytes(raw))
        except ValidationError as exc:
            raise invalid_body(exc) from exc
        e = eng()
        async with e.lock:  # never while a round is being received or applied
            try:
                await plane.init(e, req)
            except ValueError as exc:
                raise http_error(400, str(exc)) from exc
            except Exception as exc:  # rendezvous failures (timeout, refused) -> 502 with reason
                raise http_error(
                    502,
                    f"could not join the weight group at {req.master_address}:"
                    f"{req.master_port}: {type(exc).__name__}: {exc}",
                ) from exc
        body = CollectiveInitResponse(
            rank=plane.rank,
            world_size=plane.world_size,
            backend=plane.backend,
            workers=plane.workers,
        )
        return JSONResponse(body.model_dump())

    @router.post("/v1/weights/collective/update", dependencies=[Depends(authorize)])
    async def collective_update(
        request: Request, version: int = Query(..., ge=0, le=MAX_POLICY_VERSION)
    ) -> JSONResponse:
        t0 = time.monotonic()
        e = eng()
        raw = await read_body_once(request, MAX_CONTROL_BODY_BYTES)
        try:
            req = CollectiveUpdateRequest.model_validate_json(bytes(raw))
        except ValidationError as exc:
            _outcome("collective", "rejected")
            raise invalid_body(exc) from exc
        if not plane.ready:
            raise http_error(
                400, "no weight group: POST /v1/weights/collective/init before updates"
            )
        rnd = req.round
        try:
            for name, dt, shape in zip(req.names, req.dtypes, req.shapes):
                e.spec.check_meta(name, WIRE_DTYPES[dt], tuple(shape))
            missing = e.spec.missing(req.names)
            if missing:
                raise WeightValidationError(
                    f"the collective plane takes complete updates; {len(missing)} parameter(s) "
                    f"missing, e.g. {missing[:3]}: send the whole state dict, or send a "
                    "partial one to POST /v1/weights"
                )
        except WeightValidationError as exc:
            plane.ack(rnd, f"rejected: {exc}")
            _outcome("collective", "rejected")
            raise http_error(exc.status, str(exc)) from exc
        async with e.lock:
            if version <= e.version:
                plane.ack(rnd, f"conflict: version {version} <= {e.version}")
                raise _conflict(e, "collective", version)
            meta = {
                "names": req.names,
                "dtypes": req.dtypes,
                "shapes": req.shapes,
                "skip": [n for n in req.names if n in e.spec.aliases],
            }
            try:
                await e.transfer_receive(rnd, meta)
            except Exception as exc:
                plane.ack(rnd, f"error: the workers cannot receive: {exc}")
                _outcome("collective", "error")
                raise http_error(502, f"the vLLM workers cannot receive: {exc}") from exc
            try:
                plane.ack(rnd)
                refused = [s for s in await plane.received(rnd) if s != ACK_OK]
            except BaseException:  # the workers' round must not outlive this request
                with contextlib.suppress(Exception):
                    await e.transfer_discard(rnd)
                raise
            if refused:
                await e.transfer_discard(rnd)
                if refused[0] == ABORTED:
                    _outcome("collective", "aborted")
                    raise http_error(409, "round aborted by the sender (another replica refused)")
                if refused[0].startswith(REJECTED):
                    _outcome("collective", "rejected")
                    raise http_error(422, refused[0].removeprefix(REJECTED))
                _outcome("collective", "error")
                raise http_error(502, f"the broadcast failed: {refused[0]}")
            metrics.weight_bytes.labels("collective").inc(
                sum(
                    math.prod(shape) * WIRE_DTYPES[dt].itemsize
                    for dt, shape in zip(req.dtypes, req.shapes)
                )
            )
            swap = e.transfer_swap(version, rnd, lambda: plane.reload_seconds(rnd))
            return await _apply(e, "collective", version, swap, t0)

    return router
