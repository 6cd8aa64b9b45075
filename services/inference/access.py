"""Who may call what on ``ludic inference``: the weight routes take the weight token
(``auth_token``: 403 when the server has none, unless ``insecure_no_auth``), the generation
and read routes the API key or the (stronger) weight token (open when no API key is set)."""

from __future__ import annotations

import hmac
import logging

from fastapi import HTTPException, Request

from services.inference.context import http_error
from services.inference.metrics import InferenceMetrics
from services.inference.settings import InferenceSettings

log = logging.getLogger("ludic.inference")


class Access:
    """FastAPI dependencies: ``authorize`` (weight routes) and ``may_read`` (the rest);
    building it logs what is open."""

    def __init__(self, settings: InferenceSettings, metrics: InferenceMetrics) -> None:
        self.settings, self.metrics = settings, metrics
        if not settings.weight_updates_allowed:
            log.warning(
                "no auth token configured: weight updates will be refused (403); set "
                "LUDIC_AUTH_TOKEN or --auth-token-file"
            )
        elif settings.insecure_no_auth and not settings.auth_token:
            log.warning(
                "--insecure-no-auth: ANYONE who can reach this port can replace the weights"
            )
        if not settings.api_key:
            log.warning(
                "no LUDIC_API_KEY: the generation routes (/v1/completions, "
                "/v1/chat/completions, /v1/models, /v1/policy_version) are open to whoever can "
                "reach %s:%d",
                settings.host,
                settings.port,
            )
        # the tokens a generation or read route takes: its own, and the weight token
        self.readers = [t.encode() for t in (settings.api_key, settings.auth_token) if t]

    def authorize(self, request: Request) -> None:
        token = self.settings.auth_token
        if not token:
            if self.settings.insecure_no_auth:
                return
            raise http_error(
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

    def may_read(self, request: Request) -> None:
        if not self.settings.api_key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and any(
            hmac.compare_digest(given.strip().encode(), t) for t in self.readers
        )
        if not ok:
            path = request.url.path
            endpoint = "chat" if path.endswith("/chat/completions") else path.rsplit("/", 1)[-1]
            self.metrics.requests.labels(endpoint, "401").inc()
            raise HTTPException(
                status_code=401,
                detail="missing or wrong bearer token (Authorization: Bearer <LUDIC_API_KEY>)",
                headers={"WWW-Authenticate": "Bearer"},
            )
