"""The launcher's one HTTP client, for its health probes and metrics scrapes.

Each ``httpx.get`` builds a client, and a client's TLS context alone costs ~15 ms of CPU:
at one probe per service per second that is a tenth of a core, taken from the cores the
services share. One kept client costs it once and reuses its connections.
"""

from __future__ import annotations

import threading

import httpx

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


def get(url: str, timeout_s: float) -> httpx.Response:
    """``GET url`` with the kept client (raises ``httpx.HTTPError`` as ``httpx.get``)."""
    return client().get(url, timeout=timeout_s)
