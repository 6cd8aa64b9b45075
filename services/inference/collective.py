"""Replica side of the collective weight plane (protocol in libludic/distributed/weight_sync.py).

The API-server process is this replica's rank in the weight group: it receives every tensor
into a fresh buffer, then the update takes the same path as an HTTP body (validation,
version rule, pause/reload/resume). Blocking group calls run in a thread so the event loop
keeps serving generations while a broadcast is in flight.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from libludic.distributed.weight_sync import (
    ACK_OK,
    GO,
    WIRE_DTYPES,
    WeightGroup,
    open_weight_group,
    wait_key,
)
from services.inference.schemas import CollectiveInitRequest, CollectiveUpdateRequest


@dataclass
class CollectiveReceiver:
    timeout_s: float = 600.0
    group: WeightGroup | None = None

    @property
    def ready(self) -> bool:
        return self.group is not None

    async def init(self, req: CollectiveInitRequest) -> WeightGroup:
        if self.group is not None:  # a restarted learner re-initialises: drop the old group
            self.group.close()
            self.group = None
        self.group = await asyncio.to_thread(
            open_weight_group,
            req.master_address,
            req.master_port,
            req.rank,
            req.world_size,
            req.backend,
            self.timeout_s,
        )
        return self.group

    def ack(self, rnd: int, value: str = ACK_OK) -> None:
        """Tell the sender whether this rank will take part in round ``rnd``."""
        if self.group is not None:
            self.group.store.set(f"ack/{rnd}/{self.group.rank}", value[:2000])

    async def wait_go(self, rnd: int) -> bool:
        assert self.group is not None
        val = await asyncio.to_thread(wait_key, self.group.store, f"go/{rnd}", self.timeout_s)
        return val == GO

    async def receive(self, req: CollectiveUpdateRequest) -> dict[str, torch.Tensor]:
        assert self.group is not None
        group = self.group

        def _recv() -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for name, dt, shape in zip(req.names, req.dtypes, req.shapes):
                t = torch.empty(tuple(shape), dtype=WIRE_DTYPES[dt], device=group.device)
                group.broadcast(t, src=0)
                out[name] = t if t.device.type == "cpu" else t.cpu()
            return out

        return await asyncio.to_thread(_recv)
