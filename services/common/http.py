"""A tiny asyncio HTTP endpoint for a service: ``GET /metrics`` and ``GET /health``.

No threads: it runs on the service's event loop, so ``/health`` answering at all proves the
loop is alive, and ``health()`` (the service's own check, e.g. "last loop tick < 30 s ago
and Redis reachable") decides 200 vs 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

HealthFn = Callable[[], Awaitable[bool]]


async def start_http(
    port: int,
    health: HealthFn | None = None,
    registry: CollectorRegistry = REGISTRY,
    host: str = "0.0.0.0",
    render: Callable[[], bytes] | None = None,
) -> asyncio.AbstractServer | None:
    """Serve /metrics and /health on ``port`` (0 disables; returns None). /metrics is
    ``render()`` when given, else ``registry``'s exposition."""
    if port <= 0:
        return None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while True:  # skip headers
                h = await asyncio.wait_for(reader.readline(), 5)
                if h in (b"\r\n", b"\n", b""):
                    break
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) > 1 else "/"
            if path == "/metrics":
                body = render() if render is not None else generate_latest(registry)
                status, ctype = "200 OK", CONTENT_TYPE_LATEST
            elif path == "/health":
                ok = True if health is None else bool(await health())
                status = "200 OK" if ok else "503 Service Unavailable"
                ctype, body = "text/plain", (b"ok\n" if ok else b"unhealthy\n")
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    log.info("metrics and health on http://%s:%d/metrics", host, port)
    return server
