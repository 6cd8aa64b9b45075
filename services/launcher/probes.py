"""The launcher's one HTTP client, for its health probes and metrics scrapes.

Each ``httpx.get`` builds a client, and a client's TLS context alone costs ~15 ms of CPU:
at one probe per service per second that is a tenth of a core, taken from the cores the
services share. One kept client costs it once and reuses its connections.
"""

from __future__ import annotations

import threading

import httpx
import redis

from services.common.settings import redact_url

_lock = threading.Lock()
_client: httpx.Client | None = None


def client() -> httpx.Client:
    """The one client (built once, whichever thread asks first: the watchdog polls from
    a thread per service; an httpx.Client may then be shared between threads)."""
    global _client
    with _lock:
        if _client is None:
            _client = httpx.Client()
        return _client


def get(url: str, timeout_s: float, token: str | None = None) -> httpx.Response:
    """``GET url`` with the kept client (raises ``httpx.HTTPError`` as ``httpx.get``),
    with ``Authorization: Bearer token`` when given."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return client().get(url, timeout=timeout_s, headers=headers)


def check(url: str, timeout_s: float) -> str | None:
    """One health probe: None when healthy, else why not. ``http(s)://``: a 200 answered
    within ``timeout_s``; ``redis://``: a PING answered (after AUTH when the URL has a
    password), redis-server having no HTTP endpoint of its own. The reason never holds
    the URL's password."""
    if url.startswith(("redis://", "rediss://")):
        try:
            with redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            ) as r:
                r.ping()
        except redis.RedisError as e:
            return redact_url(f"{type(e).__name__}: {e}")
        return None
    try:
        r = get(url, timeout_s)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    if r.status_code == 200:
        return None
    return f"HTTP {r.status_code}: {r.text[:200].strip()}"
