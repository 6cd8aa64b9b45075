"""Process lifecycle shared by the services: stop signals and the shared Redis gauges
(stream lengths, and Redis's own footprint: memory against maxmemory, keys with and without
an expiry)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator

import redis.asyncio as aioredis
from prometheus_client import Gauge

from libludic import transport

STREAM_LENGTH = Gauge(
    "ludic_stream_length", "Un-acked entries (XLEN) of each Ludic stream", ["stream"]
)
REDIS_MEMORY = Gauge(
    "ludic_redis_memory_bytes",
    "Redis's used_memory and its maxmemory (0: no limit), from INFO memory",
    ["kind"],
)
REDIS_KEYS = Gauge(
    "ludic_redis_keys",
    "Keys in Redis's database, with an expiry (de-dup markers) and without (streams, "
    "hashes, counters: a few per run; a rising count without expiry is a leak)",
    ["expiry"],
)


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set ``stop``: the service stops taking work and drains, and its
    Redis retries give up at once (``transport.stop_retrying``: a stopping service does not
    wait for a Redis that may be gone, e.g. when ``ludic up`` died and stops everything)."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        transport.stop_retrying()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass


class StartupAborted(BaseException):
    """A stop signal arrived during a start-up that blocks the event loop. A BaseException
    so that neither ``except Exception`` nor a library's ``except KeyboardInterrupt`` (vLLM
    0.32 swallows one while it waits for its engine core's handshake) catches it."""


@contextlib.contextmanager
def abort_on_stop_signals() -> Iterator[None]:
    """Within the block, SIGTERM / SIGINT raise ``StartupAborted`` (``service_main`` exits 0).

    For a start-up step that blocks the event loop (vLLM builds its engine synchronously for
    tens of seconds): the ``stop`` event would only be seen once it finished, past a container
    runtime's stop timeout. The previous handlers are restored on leaving the block. Outside
    the main thread (in-process tests) signals cannot be handled and nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise StartupAborted(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to ``seconds``; True if ``stop`` was set."""
    return await transport.wait_event(stop, seconds)


async def update_stream_gauges(r: aioredis.Redis, keys: transport.Keys) -> dict[str, int]:
    out = await transport.stream_lengths(r, keys.streams())
    for name, n in out.items():
        STREAM_LENGTH.labels(stream=name).set(n)
    return out


async def update_footprint_gauges(r: aioredis.Redis) -> dict[str, int]:
    """Redis's footprint (INFO memory and keyspace: O(1) for Redis) into the gauges above;
    returns it. Keys are counted over the connection's database, every run's alike."""
    mem = await r.info("memory")
    space = await r.info("keyspace")
    db = space.get(f"db{r.connection_pool.connection_kwargs.get('db', 0)}") or {}
    keys, expiring = int(db.get("keys", 0)), int(db.get("expires", 0))
    out = {
        "used_memory": int(mem["used_memory"]),
        "maxmemory": int(mem.get("maxmemory", 0)),
        "keys_with_expiry": expiring,
        "keys_without_expiry": keys - expiring,
    }
    REDIS_MEMORY.labels(kind="used").set(out["used_memory"])
    REDIS_MEMORY.labels(kind="max").set(out["maxmemory"])
    REDIS_KEYS.labels(expiry="yes").set(expiring)
    REDIS_KEYS.labels(expiry="no").set(keys - expiring)
    return out
