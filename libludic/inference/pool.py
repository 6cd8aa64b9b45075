"""Round-robin ChatClient over several inference replicas, with health checks.

``InferencePool(urls)`` spreads ``complete()`` calls over the replicas in turn. When a
call fails with an InferenceError (the client already retried transient HTTP errors),
the pool asks that replica's ``/health``: unhealthy -> the replica is marked down for
``down_for_s`` and the call is retried on the next replica; healthy -> the request itself
was bad, so the error is re-raised (retrying it elsewhere would fail the same way). A
down replica is tried again after ``down_for_s`` (half-open). When every replica is down,
the pool waits for the soonest to come back, up to ``all_down_wait_s``, then raises.

``get_policy_version()`` is the *smallest* version among healthy replicas: the most
stale weights the next completion could be served by, which is what admission control
must compare against the learner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from libludic.inference.client import InferenceError
from libludic.inference.openai_client import OpenAIChatClient
from libludic.inference.request import ChatCompletionRequest
from libludic.types import ChatResponse

log = logging.getLogger(__name__)


@dataclass
class Replica:
    url: str
    client: Any
    down_until: float = 0.0
    failures: int = 0

    def up(self, now: float) -> bool:
        return now >= self.down_until


def _default_factory(url: str, api_key: str | None, timeout_s: float, max_retries: int) -> Any:
    return OpenAIChatClient(url, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries)


class InferencePool:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 1,
        down_for_s: float = 5.0,
        all_down_wait_s: float = 30.0,
        client_factory: Callable[[str], Any] | None = None,
        on_replica_down: Callable[[str], None] | None = None,
    ) -> None:
        urls = [u.strip() for u in urls if u and u.strip()]
        if not urls:
            raise ValueError(
                "InferencePool needs at least one inference URL; set LUDIC_INFERENCE_URLS="
                "http://host:8000[,http://host2:8000]"
            )
        make = client_factory or (lambda u: _default_factory(u, api_key, timeout_s, max_retries))
        self.replicas: list[Replica] = [Replica(u, make(u)) for u in urls]
        self.down_for_s = down_for_s
        self.all_down_wait_s = all_down_wait_s
        self.on_replica_down = on_replica_down
        self._next = 0

    def _order(self) -> list[Replica]:
        """Replicas starting at the round-robin cursor, up ones first."""
        n = len(self.replicas)
        start = self._next % n
        self._next = (self._next + 1) % n
        ring = [self.replicas[(start + i) % n] for i in range(n)]
        now = time.monotonic()
        return [r for r in ring if r.up(now)]

    def _mark_down(self, rep: Replica, why: str) -> None:
        rep.failures += 1
        rep.down_until = time.monotonic() + self.down_for_s
        log.warning("inference replica %s marked down for %.1fs: %s", rep.url, self.down_for_s, why)
        if self.on_replica_down is not None:
            self.on_replica_down(rep.url)

    async def _replica_healthy(self, rep: Replica) -> bool:
        health = getattr(rep.client, "health", None)
        if health is None:
            return False
        try:
            return bool(await health())
        except Exception:  # a health probe that raises is an unhealthy replica
            return False

    async def _wait_for_any(self) -> None:
        deadline = time.monotonic() + self.all_down_wait_s
        while True:
            now = time.monotonic()
            if any(r.up(now) for r in self.replicas):
                return
            if now >= deadline:
                raise InferenceError(
                    f"all {len(self.replicas)} inference replicas are down "
                    f"({', '.join(r.url for r in self.replicas)}); check `ludic inference` health"
                )
            soonest = min(r.down_until for r in self.replicas)
            await asyncio.sleep(max(0.05, min(soonest - now, deadline - now)))

    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]:
        errors: list[str] = []
        for _ in range(2):  # a second sweep after waiting for a replica to come back
            await self._wait_for_any()
            for rep in self._order():
                try:
                    resp, info = await rep.client.complete(request)
                except InferenceError as e:
                    if await self._replica_healthy(rep):
                        raise  # the request is bad, not the replica
                    self._mark_down(rep, str(e))
                    errors.append(f"{rep.url}: {e}")
                    continue
                rep.failures = 0
                info = dict(info or {})
                info.setdefault("url", rep.url)
                return resp, info
        raise InferenceError(
            "no inference replica could serve the request: " + "; ".join(errors[-4:])
        )

    async def get_policy_version(self) -> int:
        versions: list[int] = []
        now = time.monotonic()
        for rep in self.replicas:
            if not rep.up(now):
                continue
            try:
                versions.append(int(await rep.client.get_policy_version()))
            except Exception as e:  # counted as a replica failure, never swallowed silently
                self._mark_down(rep, f"policy_version: {e}")
        if not versions:
            raise InferenceError(
                "no healthy inference replica answered /v1/policy_version "
                f"({', '.join(r.url for r in self.replicas)})"
            )
        return min(versions)

    async def health(self) -> bool:
        """Probe every replica; mark the unhealthy ones down. True if any is up."""
        ok = False
        for rep in self.replicas:
            if await self._replica_healthy(rep):
                rep.down_until = 0.0
                ok = True
            else:
                self._mark_down(rep, "health probe failed")
        return ok

    def sync_weights(
        self, params: Mapping[str, Any], timeout_s: float = 600.0, version: int | None = None
    ) -> str:
        """Push ``params`` as ``version`` to every replica, in parallel, through each
        replica client's own ``sync_weights`` (the HTTP weight plane for OpenAIChatClient).
        Every replica must acknowledge; otherwise InferenceError names each one that did not
        (replicas that did keep the new weights). Down-marking is ignored: a replica marked
        down must still get the weights. The services' learner publishes through
        libludic.distributed.publisher instead (retries, 409 resolution, the collective
        plane); this is the ChatClient contract for a library user holding a pool."""
        if version is None:
            raise ValueError("InferencePool.sync_weights needs an explicit version")
        with ThreadPoolExecutor(max_workers=len(self.replicas)) as ex:
            futs = {
                r.url: ex.submit(r.client.sync_weights, params, timeout_s, version)
                for r in self.replicas
            }
        failures: dict[str, str] = {}
        for url, fut in futs.items():
            try:
                fut.result()
            except Exception as e:  # collected: every replica's outcome is reported
                failures[url] = f"{type(e).__name__}: {e}"
        if failures:
            raise InferenceError(
                f"sync_weights v{version} failed on {len(failures)} of {len(self.replicas)} "
                f"replica(s): {failures}"
            )
        return f"policy_version={version} on {len(self.replicas)} replica(s)"

    async def aclose(self) -> None:
        for rep in self.replicas:
            close = getattr(rep.client, "aclose", None)
            if close is not None:
                await close()
