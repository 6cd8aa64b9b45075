"""What every route of ``ludic inference`` shares: the served engine (``AppContext``), the
HTTP helpers (errors, bounded body reads, versioned replies) and the limits."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from services.inference.collective import CollectivePlane
from services.inference.metrics import InferenceMetrics
from services.inference.settings import InferenceSettings

VERSION_HEADER = "X-Ludic-Policy-Version"
#: policy versions are exact in a float64 (the Prometheus gauge) and in JSON
MAX_POLICY_VERSION = 2**53 - 1
INITIAL_BODY_BUFFER = 1 << 20
MAX_CONTROL_BODY_BYTES = 16 << 20  # JSON bodies of the collective plane (names, shapes)


@dataclass
class AppContext:
    """The app's state: its settings, metrics, collective plane and engine (None until the
    lifespan started it); ``in_flight`` counts the generation requests admitted and not
    finished (streams included)."""

    settings: InferenceSettings
    metrics: InferenceMetrics
    plane: CollectivePlane
    engine: Any = None
    in_flight: list[int] = field(default_factory=lambda: [0])

    def eng(self) -> Any:
        """The engine, or 503 while it starts."""
        if self.engine is None:
            raise http_error(503, "engine is starting")
        return self.engine


def versioned(body: Any, version: int, status: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers={VERSION_HEADER: str(version)})


def http_error(status: int, detail: str) -> HTTPException:
    return HTTPException(status_code=status, detail=detail)


def invalid_body(exc: ValidationError) -> HTTPException:
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
            raise http_error(400, f"bad Content-Length {cl!r}") from e
        if size < 0:
            raise http_error(400, f"bad Content-Length {cl!r}")
        if size > max_bytes:
            raise http_error(413, f"body of {size} bytes exceeds {limit_name}={max_bytes}")
    limit = max_bytes if size is None else size
    buf = bytearray(min(limit, INITIAL_BODY_BUFFER))
    pos = 0
    async for chunk in request.stream():
        end = pos + len(chunk)
        if end > limit:
            if size is not None:
                raise http_error(400, "body is longer than its Content-Length")
            raise http_error(413, f"body exceeds {limit_name}={max_bytes}")
        if end > len(buf):
            buf.extend(bytes(min(limit, max(end, 2 * len(buf))) - len(buf)))
        buf[pos:end] = chunk
        pos = end
    if size is not None and pos != size:
        raise http_error(400, f"body truncated: got {pos} of {size} bytes")
    del buf[pos:]
    return buf
