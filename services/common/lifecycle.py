"""Process lifecycle shared by the services: stop signals and the shared stream gauge."""

from __future__ import annotations

import asyncio
import signal

import redis.asyncio as aioredis
from prometheus_client import Gauge

from libludic import transport

STREAM_LENGTH = Gauge(
    "ludic_stream_length", "Un-acked entries (XLEN) of each Ludic stream", ["stream"]
)


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set ``stop``: the service stops taking work and drains."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to ``seconds``; True if ``stop`` was set."""
    return await transport.wait_event(stop, seconds)


async def update_stream_gauges(r: aioredis.Redis, keys: transport.Keys) -> dict[str, int]:
    out = await transport.stream_lengths(r, keys.streams())
    for name, n in out.items():
        STREAM_LENGTH.labels(stream=name).set(n)
    return out
