"""FastAPI app of ``ludic inference``: vLLM's OpenAI serving + versioned weight updates.

``create_app(settings, engine=None)`` builds the app; with ``engine=None`` the lifespan
starts a real ``LudicEngine`` (vLLM), otherwise the given engine (or a fake with the same
attributes: ``version``, ``lock``, ``spec``, ``swap``, ``probe``, ``serving``, and for the
collective plane ``transfer_workers``, ``transfer_backends``, ``transfer_init``,
``transfer_receive``, ``transfer_discard``, ``transfer_swap``) is used. The routes, one
module per concern under services/inference/routes/: ``status`` (health, metrics, the
served version), ``generation`` (the OpenAI routes, each reply with its
``policy_version``), ``weights`` (HTTP, adapter and collective updates); who may call them:
services/inference/access.py; what they share: services/inference/context.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from services.inference.access import Access
from services.inference.collective import CollectivePlane
from services.inference.context import AppContext
from services.inference.metrics import InferenceMetrics
from services.inference.routes.generation import generation_routes
from services.inference.routes.status import status_routes
from services.inference.routes.weights import weight_routes
from services.inference.settings import InferenceSettings
from services.inference.worker import LudicEngine


def create_app(
    settings: InferenceSettings,
    engine: Any | None = None,
    metrics: InferenceMetrics | None = None,
) -> FastAPI:
    metrics = metrics or (engine.metrics if engine is not None else InferenceMetrics())
    plane = CollectivePlane(timeout_s=settings.collective_timeout_s)
    ctx = AppContext(settings, metrics, plane, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = ctx.engine is None
        if owned:
            ctx.engine = await LudicEngine.start(settings, metrics)
        metrics.policy_version.set(ctx.engine.version)
        try:
            yield
        finally:
            if owned:
                await ctx.engine.shutdown()

    app = FastAPI(title="ludic inference", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.collective = plane
    access = Access(settings, metrics)
    for routes in (status_routes, generation_routes, weight_routes):
        app.include_router(routes(ctx, access))
    return app
