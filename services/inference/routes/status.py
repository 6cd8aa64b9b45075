"""Status routes of ``ludic inference``: ``/health`` (the engine's probe), ``/metrics``
(unless main.py serves it on its own port) and ``/v1/policy_version`` (the served version
and dtype)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from services.inference.access import Access
from services.inference.context import AppContext, versioned
from services.inference.schemas import HealthResponse, PolicyVersionResponse


def status_routes(ctx: AppContext, access: Access) -> APIRouter:
    router = APIRouter()
    settings, metrics, eng, may_read = ctx.settings, ctx.metrics, ctx.eng, access.may_read

    # ------------------------------------------------------------------ status
    @router.get("/health")
    async def health() -> JSONResponse:
        e = ctx.engine
        if e is None:
            body = HealthResponse(status="unhealthy", policy_version=0, reason="starting")
            return JSONResponse(body.model_dump(), status_code=503)
        ok, reason = await e.probe()
        body = HealthResponse(
            status="ok" if ok else "unhealthy", policy_version=e.version, reason=reason
        )
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    if settings.metrics_port is None:  # else main.py serves it on its own port

        @router.get("/metrics")
        async def prometheus() -> Response:
            return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get(
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

    return router
