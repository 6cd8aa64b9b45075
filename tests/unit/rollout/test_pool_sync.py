"""InferencePool.sync_weights pushes to every replica."""

from __future__ import annotations

from typing import Any

import pytest

from libludic.inference.client import InferenceError
from libludic.inference.pool import InferencePool


class Client:
    """A replica's client recording the weights it was sent, or refusing them (kept here:
    the pool's fan-out is the only user of a client that records sync_weights)."""

    def __init__(self, url: str, fail: bool = False) -> None:
        self.url, self.fail, self.got = url, fail, []

    def sync_weights(
        self, params: Any, timeout_s: float = 600.0, version: int | None = None
    ) -> str:
        if self.fail:
            raise InferenceError(f"{self.url}: 503")
        self.got.append((dict(params), version))
        return f"policy_version={version}"


def pool(*fail: str) -> tuple[InferencePool, dict[str, Client]]:
    clients = {u: Client(u, u in fail) for u in ("http://a", "http://b", "http://c")}
    return InferencePool(list(clients), client_factory=lambda u: clients[u]), clients


def test_every_replica_gets_the_weights_and_version() -> None:
    p, clients = pool()
    assert p.sync_weights({"w": 1}, version=4) == "policy_version=4 on 3 replica(s)"
    assert all(c.got == [({"w": 1}, 4)] for c in clients.values())


def test_a_failed_replica_is_named_and_the_others_still_updated() -> None:
    p, clients = pool("http://b")
    with pytest.raises(InferenceError, match=r"v5 failed on 1 of 3 .*http://b.*503"):
        p.sync_weights({"w": 2}, version=5)
    assert clients["http://a"].got == clients["http://c"].got == [({"w": 2}, 5)]


def test_version_is_required() -> None:
    p, _ = pool()
    with pytest.raises(ValueError, match="explicit version"):
        p.sync_weights({"w": 1})
