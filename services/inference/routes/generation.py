"""The OpenAI routes of ``ludic inference`` (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``): vLLM's own ``OpenAIServingCompletion`` / ``OpenAIServingChat`` /
``OpenAIServingModels`` behind the server's limits (``max_n``, ``max_tokens_limit``,
``max_request_bytes``, ``max_concurrent_requests``), every reply and stream chunk labelled
with the ``policy_version`` that produced it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from services.inference.access import Access
from services.inference.context import (
    VERSION_HEADER,
    AppContext,
    http_error,
    read_body_once,
    versioned,
)
from services.inference.metrics import InferenceMetrics
from services.inference.token_text import decodes_once, fill_text
from services.inference.worker import COLLECTOR, VersionCollector


def generation_routes(ctx: AppContext, access: Access) -> APIRouter:
    router = APIRouter()
    settings, metrics, eng, may_read = ctx.settings, ctx.metrics, ctx.eng, access.may_read
    in_flight = ctx.in_flight

    @router.get("/v1/models", dependencies=[Depends(may_read)])
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
            raise http_error(404, f"the model does not support /v1/{endpoint}")
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

    @router.post("/v1/completions", dependencies=[Depends(may_read)])
    async def completions(raw_request: Request) -> Response:
        return await _openai(raw_request, "completions")

    @router.post("/v1/chat/completions", dependencies=[Depends(may_read)])
    async def chat_completions(raw_request: Request) -> Response:
        return await _openai(raw_request, "chat")

    return router


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
