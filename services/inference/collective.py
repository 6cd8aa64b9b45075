"""API-server end of the collective weight plane: the control side of one replica.

The tensors never pass through this process: the replica's vLLM workers are its ranks in
the learner's weight group (the ``ludic`` weight-transfer engine,
services/inference/weight_transfer.py), ``rank .. rank + workers - 1``. This process holds a
client of the group's TCPStore for the control keys (named in
libludic/distributed/weight_sync.py; the round: DEVELOPERS.md, "Inference service HTTP
API"): it writes the replica's ack under its first rank and
reads its workers' joined/recvd/applied keys. Store waits run in a thread, so the event
loop keeps serving generations while a broadcast is in flight.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from libludic.distributed.weight_sync import (
    ACK_OK,
    FAILED,
    ack_key,
    applied_key,
    joined_key,
    open_store,
    recvd_key,
    wait_keys,
)
from services.inference.schemas import CollectiveInitRequest

#: longest wait for the workers' applied keys, written right after the load RPC returned
APPLIED_WAIT_S = 30.0


@dataclass
class CollectivePlane:
    timeout_s: float = 600.0
    store: Any = None  # a client of the learner's TCPStore; None before a good init
    rank: int = 0  # the replica's first rank in the group
    workers: int = 0
    world_size: int = 0
    backend: str = ""

    @property
    def ready(self) -> bool:
        return self.store is not None

    @property
    def ranks(self) -> range:
        return range(self.rank, self.rank + self.workers)

    async def init(self, engine: Any, req: CollectiveInitRequest) -> None:
        """Every worker of ``engine`` joins the group the learner hosts; returns once all
        joined. ``ValueError``: the request does not fit this replica (400); any other
        exception: the rendezvous failed (502)."""
        workers = int(engine.transfer_workers)
        backends = tuple(engine.transfer_backends)
        if req.backend not in backends:
            raise ValueError(
                f"backend {req.backend!r}: this replica's workers can join {list(backends)} "
                "(nccl needs CUDA workers)"
            )
        if req.rank + workers > req.world_size:
            raise ValueError(
                f"this replica runs {workers} vLLM worker(s), ranks {req.rank}.."
                f"{req.rank + workers - 1}, outside world_size {req.world_size}; count every "
                "replica's workers (GET /v1/weights/collective)"
            )
        self.close()
        store = await asyncio.to_thread(
            open_store, req.master_address, req.master_port, self.timeout_s
        )
        await engine.transfer_init(
            {
                "master_address": req.master_address,
                "master_port": req.master_port,
                "world_size": req.world_size,
                "rank_offset": req.rank,
                "backend": req.backend,
                "timeout_s": self.timeout_s,
            }
        )
        ranks = range(req.rank, req.rank + workers)
        joined = await asyncio.to_thread(
            wait_keys, store, [joined_key(r) for r in ranks], self.timeout_s
        )
        bad = [f"rank {r}: {v}" for r, v in zip(ranks, joined) if v != ACK_OK]
        if bad:
            raise RuntimeError("; ".join(bad))
        self.store, self.rank, self.workers = store, req.rank, workers
        self.world_size, self.backend = req.world_size, req.backend

    def ack(self, rnd: int, value: str = ACK_OK) -> None:
        """Tell the sender whether this replica takes part in round ``rnd``."""
        if self.store is not None:
            self.store.set(ack_key(rnd, self.rank), value[:2000])

    async def received(self, rnd: int) -> list[str]:
        """Each worker's outcome of round ``rnd`` (``weight_sync.recvd_key``), or the reason
        none came (the store or the learner went away, or the wait timed out)."""
        keys = [recvd_key(rnd, r) for r in self.ranks]
        try:
            return await asyncio.to_thread(wait_keys, self.store, keys, self.timeout_s)
        except Exception as e:  # a lost store is the outcome of this round, reported as such
            return [f"{FAILED}{type(e).__name__}: {e}"]

    async def reload_seconds(self, rnd: int) -> float:
        """The slowest worker's load time of round ``rnd``."""
        keys = [applied_key(rnd, r) for r in self.ranks]
        values = await asyncio.to_thread(wait_keys, self.store, keys, APPLIED_WAIT_S)
        return max(float(v) for v in values)

    def close(self) -> None:
        self.store = None
        self.rank = self.workers = self.world_size = 0
        self.backend = ""
