"""FastAPI app of ``ludic inference``: vLLM's OpenAI serving + versioned weight updates.

``create_app(settings, engine=None)`` builds the app; with ``engine=None`` the lifespan
starts a real ``LudicEngine`` (vLLM), otherwise the given engine (or a fake with the same
attributes: ``version``, ``lock``, ``spec``, ``swap``, ``probe``, ``serving``, and for the
collective plane ``transfer_workers``, ``transfer_backends``, ``transfer_init``,
``transfer_receive``, ``transfer_discard``, ``transfer_swap``) is used.
The OpenAI endpoints delegate to vLLM's own ``OpenAIServingCompletion`` /
``OpenAIServingChat`` / ``OpenAIServingModels`` and add ``policy_version``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from libludic.distributed.weight_sync import (
    ABORTED,
    ACK_OK,
    ADAPTER_ROUTE,
    REJECTED,
    WIRE_DTYPES,
)
from services.inference.collective import CollectivePlane
from services.inference.metrics import InferenceMetrics
from services.inference.schemas import (
    CollectiveInfoResponse,
    CollectiveInitRequest,
    CollectiveInitResponse,
    CollectiveUpdateRequest,
    HealthResponse,
    PolicyVersionResponse,
)
from services.inference.settings import InferenceSettings
from services.inference.token_text import decodes_once, fill_text
from services.inference.validation import (
    WeightValidationError,
    decode_adapter,
    decode_and_validate,
)
from services.inference.worker import COLLECTOR, LudicEngine, SwapError, VersionCollector

log = logging.getLogger("ludic.inference")
VERSION_HEADER = "X-Ludic-Policy-Version"
#: policy versions are exact in a float64 (the Prometheus gauge) and in JSON
MAX_POLICY_VERSION = 2**53 - 1
INITIAL_BODY_BUFFER = 1 << 20
MAX_CONTROL_BODY_BYTES = 16 << 20  # JSON bodies of the collective plane (names, shapes)


def _http_error(status: int, detail: str) -> HTTPException:
    return HTTPException(status_code=status, detail=detail)


def _invalid_body(exc: ValidationError) -> HTTPException:
    """422 naming what is wrong, without echoing the input: a JSON body may hold Infinity
    or NaN, which the JSON response cannot carry (it would be a 500)."""
    return HTTPException(status_code=422, detail=json.loads(exc.json(include_input=False)))


async def read_body_once(
    request: Request, max_bytes: int, limit_name: str = "the body limit"
) -> bytearray:
    """Stream the body into one buffer, never more than ``max_bytes`` (413) and never more
    than what actually arrived: a declared Content-Length is checked, not allocated (the
    buffer doubles as the bytes come, up to the declared size)."""
    cl = request.headers.get("content-length")
    size: int | None = None
    if cl is not None:
        try:
            size = int(cl)
        except ValueError as e:
            raise _http_error(400, f"bad Content-Length {cl!r}") from e
        if size < 0:
            raise _http_error(400, f"bad Content-Length {cl!r}")
        if size > max_bytes:
            raise _http_error(413, f"body of {size} bytes exceeds {limit_name}={max_bytes}")
    limit = max_bytes if size is None else size
    buf = bytearray(min(limit, INITIAL_BODY_BUFFER))
    pos = 0
    async for chunk in request.stream():
        end = pos + len(chunk)
        if end > limit:
            if size is not None:
                raise _http_error(400, "body is longer than its Content-Length")
            raise _http_error(413, f"body exceeds {limit_name}={max_bytes}")
        if end > len(buf):
            buf.extend(bytes(min(limit, max(end, 2 * len(buf))) - len(buf)))
        buf[pos:end] = chunk
        pos = end
    if size is not None and pos != size:
        raise _http_error(400, f"body truncated: got {pos} of {size} bytes")
    del buf[pos:]
    return buf


def create_app(
    settings: InferenceSettings,
    engine: Any | None = None,
    metrics: InferenceMetrics | None = None,
) -> FastAPI:
    metrics = metrics or (engine.metrics if engine is not None else InferenceMetrics())
    plane = CollectivePlane(timeout_s=settings.collective_timeout_s)
    holder: dict[str, Any] = {"engine": engine}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = holder["engine"] is None
        if owned:
            holder["engine"] = await LudicEngine.start(settings, metrics)
        metrics.policy_version.set(holder["engine"].version)
        try:
            yield
        finally:
            if owned:
                await holder["engine"].shutdown()

    app = FastAPI(title="ludic inference", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.collective = plane

    def eng() -> Any:
        e = holder["engine"]
        if e is None:
            raise _http_error(503, "engine is starting")
        return e

    if not settings.weight_updates_allowed:
        log.warning(
            "no auth token configured: weight updates will be refused (403); set "
            "LUDIC_AUTH_TOKEN or --auth-token-file"
        )
    elif settings.insecure_no_auth and not settings.auth_token:
        log.warning("--insecure-no-auth: ANYONE who can reach this port can replace the weights")

    def authorize(request: Request) -> None:
        token = settings.auth_token
        if not token:
            if settings.insecure_no_auth:
                return
            raise _http_error(
                403,
                "weight updates are disabled: the server has no auth token; start it with "
                "LUDIC_AUTH_TOKEN or --auth-token-file (or --insecure-no-auth for local tests)",
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            raise HTTPException(
                status_code=401,
                detail="missing or wrong bearer token (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    if not settings.api_key:
        log.warning(
            "no LUDIC_API_KEY: the generation routes (/v1/completions, /v1/chat/completions, "
            "/v1/models, /v1/policy_version) are open to whoever can reach %s:%d",
            settings.host,
            settings.port,
        )
    # the tokens a generation or read route takes: its own, and the (stronger) weight token
    readers = [t.encode() for t in (settings.api_key, settings.auth_token) if t]

    def may_read(request: Request) -> None:
        if not settings.api_key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and any(
            hmac.compare_digest(given.strip().encode(), t) for t in readers
        )
        if not ok:
            path = request.url.path
            endpoint = "chat" if path.endswith("/chat/completions") else path.rsplit("/", 1)[-1]
            metrics.requests.labels(endpoint, "401").inc()
            raise HTTPException(
                status_code=401,
                detail="missing or wrong bearer token (Authorization: Bearer <LUDIC_API_KEY>)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    in_flight = [0]  # generation requests admitted and not finished (streams included)

    def versioned(body: Any, version: int, status: int = 200) -> JSONResponse:
        return JSONResponse(body, status_code=status, headers={VERSION_HEADER: str(version)})

    # ------------------------------------------------------------------ status
    @app.get("/health")
    async def health() -> JSONResponse:
        e = holder["engine"]
        if e is None:
            body = HealthResponse(status="unhealthy", policy_version=0, reason="starting")
            return JSONResponse(body.model_dump(), status_code=503)
        ok, reason = await e.probe()
        body = HealthResponse(
            status="ok" if ok else "unhealthy", policy_version=e.version, reason=reason
        )
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    if settings.metrics_port is None:  # else main.py serves it on its own port

        @app.get("/metrics")
        async def prometheus() -> Response:
            return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get(
        "/v1/policy_version",
        response_model=PolicyVersionResponse,
        dependencies=[Depends(may_read)],
    )
    async def policy_version() -> JSONResponse:
        e = eng()
        served = getattr(getattr(e, "spec", None), "served_dtype", None)
        dtype = None if served is None else str(served).removeprefix("torch.")
        body = PolicyVersionResponse(policy_version=e.version, dtype=dtype)
        return versioned(body.model_dump(), e.version)

    # ------------------------------------------------------------------ OpenAI
    @app.get("/v1/models", dependencies=[Depends(may_read)])
    async def models() -> JSONResponse:
        e = eng()
        listing = await e.serving.openai_serving_models.show_available_models()
        return versioned(listing.model_dump(), e.version)

    def _refuse(endpoint: str, status: int, message: str, **headers: str) -> JSONResponse:
        metrics.requests.labels(endpoint, str(status)).inc()
        kind = {413: "RequestTooLarge", 429: "TooManyRequests"}.get(status, "BadRequestError")
        return JSONResponse(
            {"error": {"message": message, "type": kind, "code": status}},
            status_code=status,
            headers=headers or None,
        )

    def _over_limits(req: Any) -> str | None:
        """Why ``req`` asks for more than this server grants (None: it does not). A request
        without max_tokens gets ``max_tokens_limit`` when one is set."""
        n = getattr(req, "n", None) or 1
        if n > settings.max_n:
            return f"n={n} exceeds this server's max_n={settings.max_n}"
        limit = settings.max_tokens_limit
        if limit is None:
            return None
        for name in ("max_completion_tokens", "max_tokens"):
            asked = getattr(req, name, None)
            if asked is not None and asked > limit:
                return f"{name}={asked} exceeds this server's max_tokens_limit={limit}"
        if getattr(req, "max_completion_tokens", None) is None and req.max_tokens is None:
            req.max_tokens = limit
        return None

    async def _openai(raw_request: Request, endpoint: str) -> Response:
        if in_flight[0] >= settings.max_concurrent_requests:
            return _refuse(
                endpoint,
                429,
                f"{in_flight[0]} requests in flight, this server's max_concurrent_requests="
                f"{settings.max_concurrent_requests}: retry later",
                **{"Retry-After": "1"},
            )
        in_flight[0] += 1
        streaming = False
        try:
            resp = await _generate(raw_request, endpoint)
            if isinstance(resp, StreamingResponse):
                # the slot is the stream's until its last chunk went out (or it was dropped)
                streaming = True
                resp.body_iterator = _release_after(resp.body_iterator, in_flight)
            return resp
        finally:
            if not streaming:
                in_flight[0] -= 1

    async def _generate(raw_request: Request, endpoint: str) -> Response:
        e = eng()
        if endpoint == "completions":
            # vLLM's request models where a generation route runs: the weight routes and
            # their tests (tests/fakes.py's TensorEngine) build the app without vLLM
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Req

            handler = e.serving.openai_serving_completion
        else:
            from vllm.entrypoints.openai.chat_completion.protocol import (  # type: ignore[assignment]
                ChatCompletionRequest as Req,
            )

            handler = e.serving.openai_serving_chat
        try:
            body = await read_body_once(
                raw_request, settings.max_request_bytes, "max_request_bytes"
            )
        except HTTPException as exc:
            return _refuse(endpoint, exc.status_code, str(exc.detail))
        try:
            req = Req.model_validate(json.loads(body))
        except (ValidationError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            msg = exc.errors() if isinstance(exc, ValidationError) else str(exc)
            return _refuse(endpoint, 400, str(msg))
        why = _over_limits(req)
        if why is not None:
            return _refuse(endpoint, 400, why)
        if handler is None:
            raise _http_error(404, f"the model does not support /v1/{endpoint}")
        collector = VersionCollector(detokenize=not decodes_once(req, endpoint, handler))
        started_version = e.version
        token = COLLECTOR.set(collector)
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse  # as Req, above
        from vllm.entrypoints.serve.exception_handling.error_response import (  # as Req, above
            create_error_response,
        )
        from vllm.exceptions import VLLMClientError  # as Req, above

        try:
            gen = await (
                handler.create_completion(req, raw_request)
                if endpoint == "completions"
                else handler.create_chat_completion(req, raw_request)
            )
        except VLLMClientError as exc:  # the request's fault (a prompt past max_model_len): 4xx
            gen = create_error_response(exc)
        finally:
            COLLECTOR.reset(token)

        if isinstance(gen, ErrorResponse):
            metrics.requests.labels(endpoint, str(gen.error.code)).inc()
            return JSONResponse(gen.model_dump(), status_code=gen.error.code)
        if hasattr(gen, "model_dump"):
            data = gen.model_dump()
            if not collector.detokenize:
                fill_text(data, endpoint, e.tokenizer, req)
            version, mixed = collector.policy_version(e.version)
            data["policy_version"] = version
            if mixed:  # an in-flight update (update_mode=keep) happened during the request
                data["policy_versions"] = sorted(set(collector.versions))
            choices = data.get("choices") or []
            if choices and choices[0].get("prompt_token_ids") is not None:
                data["prompt_token_ids"] = choices[0]["prompt_token_ids"]
            if data.get("prompt_token_ids") is None:
                data.pop("prompt_token_ids", None)
            metrics.generated_tokens.inc(collector.tokens)
            metrics.requests.labels(endpoint, "200").inc()
            return versioned(data, version)
        metrics.requests.labels(endpoint, "200").inc()
        return StreamingResponse(
            _versioned_stream(gen, e, collector, metrics),
            media_type="text/event-stream",
            headers={VERSION_HEADER: str(started_version)},
        )

    @app.post("/v1/completions", dependencies=[Depends(may_read)])
    async def completions(raw_request: Request) -> Response:
        return await _openai(raw_request, "completions")

    @app.post("/v1/chat/completions", dependencies=[Depends(may_read)])
    async def chat_completions(raw_request: Request) -> Response:
        return await _openai(raw_request, "chat")

    # ------------------------------------------------------------------ weights (HTTP)
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
            raise _http_error(exc.status, str(exc)) from exc
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
        return _http_error(
            409,
            f"version {version} is not greater than the served policy_version {e.version}; "
            "send a larger version",
        )

    @app.post("/v1/weights", dependencies=[Depends(authorize)])
    async def post_weights(
        request: Request, version: int = Query(..., ge=0, le=MAX_POLICY_VERSION)
    ) -> JSONResponse:
        t0 = time.monotonic()
        e = eng()
        if settings.max_lora_rank > 0:
            _outcome("http", "rejected")
            raise _http_error(
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
            raise _http_error(exc.status, str(exc)) from exc
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

    @app.post(ADAPTER_ROUTE, dependencies=[Depends(authorize)])
    async def post_adapter(
        request: Request, version: int = Query(..., ge=1, le=MAX_POLICY_VERSION)
    ) -> JSONResponse:
        """A LoRA adapter (safetensors, peft names, its config in the metadata:
        validation.decode_adapter) served as ``version`` over the checkpoint's weights."""
        t0 = time.monotonic()
        e = eng()
        if settings.max_lora_rank <= 0:
            _outcome("adapter", "rejected")
            raise _http_error(
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
            raise _http_error(exc.status, str(exc)) from exc
        async with e.lock:
            if version <= e.version:
                raise _conflict(e, "adapter", version)
            return await _apply(e, "adapter", version, e.swap_adapter(version, buf, config), t0)

    # ------------------------------------------------------------------ weights (collective)
    @app.get("/v1/weights/collective", dependencies=[Depends(authorize)])
    async def collective_info() -> JSONResponse:
        e = eng()
        body = CollectiveInfoResponse(
            workers=int(e.transfer_workers), backends=list(e.transfer_backends)
        )
        return JSONResponse(body.model_dump())

    @app.post("/v1/weights/collective/init", dependencies=[Depends(authorize)])
    async def collective_init(request: Request) -> JSONResponse:
        # parsed here, after authorize: an unauthenticated body is never read
        raw = await read_body_once(request, MAX_CONTROL_BODY_BYTES)
        try:
            req = CollectiveInitRequest.model_validate_json(bytes(raw))
        except ValidationError as exc:
            raise _invalid_body(exc) from exc
        e = eng()
        async with e.lock:  # never while a round is being received or applied
            try:
                await plane.init(e, req)
            except ValueError as exc:
                raise _http_error(400, str(exc)) from exc
            except Exception as exc:  # rendezvous failures (timeout, refused) -> 502 with reason
                raise _http_error(
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

    @app.post("/v1/weights/collective/update", dependencies=[Depends(authorize)])
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
            raise _invalid_body(exc) from exc
        if not plane.ready:
            raise _http_error(
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
            raise _http_error(exc.status, str(exc)) from exc
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
                raise _http_error(502, f"the vLLM workers cannot receive: {exc}") from exc
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
                    raise _http_error(409, "round aborted by the sender (another replica refused)")
                if refused[0].startswith(REJECTED):
                    _outcome("collective", "rejected")
                    raise _http_error(422, refused[0].removeprefix(REJECTED))
                _outcome("collective", "error")
                raise _http_error(502, f"the broadcast failed: {refused[0]}")
            metrics.weight_bytes.labels("collective").inc(
                sum(
                    math.prod(shape) * WIRE_DTYPES[dt].itemsize
                    for dt, shape in zip(req.dtypes, req.shapes)
                )
            )
            swap = e.transfer_swap(version, rnd, lambda: plane.reload_seconds(rnd))
            return await _apply(e, "collective", version, swap, t0)

    return app


async def _release_after(body: Any, in_flight: list[int]) -> AsyncIterator[Any]:
    """``body``'s chunks; the request's concurrency slot is given back when the stream ends,
    fails or its client goes away (the generator is closed)."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        in_flight[0] -= 1


async def _versioned_stream(
    gen: AsyncIterator[str], e: Any, collector: VersionCollector, metrics: InferenceMetrics
) -> AsyncIterator[str]:
    """Add ``policy_version`` to every SSE data chunk: the engine's version when the chunk is
    produced, until the generation finished; then (the last chunks) the oldest version that
    produced any of its tokens, with ``policy_versions`` when an in-flight update
    (``update_mode=keep``) happened during the request."""
    async for chunk in gen:
        if chunk.startswith("data: {"):
            try:
                obj = json.loads(chunk[len("data: ") :])
            except json.JSONDecodeError:
                yield chunk
                continue
            version, mixed = collector.policy_version(e.version)
            obj["policy_version"] = version
            if mixed:
                obj["policy_versions"] = sorted(set(collector.versions))
            yield "data: " + json.dumps(obj) + "\n\n"
        else:
            yield chunk
    metrics.generated_tokens.inc(collector.tokens)
