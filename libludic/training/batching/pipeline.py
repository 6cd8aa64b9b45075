"""PipelineBatchSource: SAWItems from the Redis ``saw`` stream -> macro-batches for the Trainer.

Reading (rank 0 only): one consumer of group ``learner`` on ``ludic:{run}:saw`` with a
*stable* name (``learner-0`` by default), its own pending entries first (:meth:`start`).

Batches. A macro-batch is the next ``batch_size`` *fresh* items in stream order; it never
closes on a timeout, so the batch sequence depends only on the stream content (this is what
makes a resumed run retrain exactly the batches it lost). Freshness and trainability are
the Trainer's :class:`~libludic.training.admission.Admission` (handed over when the Trainer is
built): staleness at the served version when the batch is formed, i.e. at the start of the
step; stale items are acked, counted and never trained, untrainable ones dead-lettered.
This source only reads, judges with that Admission, and acknowledges; it calls nothing back.

Exactly-once effect (acks). An entry is acked (XACK + XDEL) only once the optimizer step
that used it is *committed*: :meth:`mark_trained` after the step, :meth:`commit` once it is
committed. :meth:`state_dict` / :meth:`load_state_dict` carry the stream position through a
checkpoint, so after ``--resume`` each item's update is in the final model exactly once,
provided the stream is only consumed by this learner.

Ranks (torch.distributed initialised): rank 0 reads Redis and broadcasts every batch; with
``shard=True`` (default) each rank trains a contiguous shard of it. All ranks stop at the
same point; after ``idle_every_s`` of waiting every rank gets :class:`SourceIdle` at the same
point, so the loop's owner may run collective work (a republish) before asking again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from libludic import transport
from libludic.saw import SAWBatch, SAWItem
from libludic.training.admission import Admission
from libludic.training.ranks import any_rank
from libludic.training.types import SourceIdle, SourceStopped
from libludic.transport import accounting

log = logging.getLogger(__name__)

DEFAULT_CONSUMER = "learner-0"
_MSG_BATCH, _MSG_WAIT, _MSG_IDLE = "batch", "wait", "idle"


def stream_id_key(eid: str) -> tuple[int, int]:
    """``"1700000000000-3"`` -> (1700000000000, 3), for comparing stream ids."""
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def broadcast_bytes(data: bytes | None, device: torch.device, src: int = 0) -> bytes:
    """Broadcast ``data`` (given on ``src``) to every rank as a uint8 tensor; returns it."""
    me = dist.get_rank()
    n = torch.tensor(
        [len(data) if me == src and data is not None else 0], dtype=torch.int64, device=device
    )
    dist.broadcast(n, src)
    size = int(n.item())
    if me == src:
        assert data is not None
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
            if size
            else torch.empty(0, dtype=torch.uint8, device=device)
        )
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    if size:
        dist.broadcast(buf, src)
    return bytes(buf.cpu().numpy().tobytes()) if me != src else (data or b"")


def shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of shard ``rank`` when ``n`` items are split into ``world`` contiguous,
    near-equal shards (the first ``n % world`` shards get one more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass
class PipelineBatchSource:
    """A BatchSource over the ``saw`` stream (see the module docstring for the contract).

    ``redis``/``keys`` are needed on rank 0 only (pass None elsewhere).
    ``stop_fn()`` True asks ``next_batch`` to give up waiting (raising :class:`SourceStopped`).

    Ranks. Rank 0 reads Redis and broadcasts every batch as msgpack bytes in a uint8 tensor
    (no pickle: ``broadcast_object_list`` would pickle). With ``shard=True`` (default, FSDP2
    data parallel) rank ``r`` trains the contiguous shard ``r`` of ``world_size`` near-equal
    shards; the Trainer normalises the loss over all ranks and FSDP2 averages gradients, so
    the update equals single-process training on the whole batch (up to float rounding).
    ``batch_size`` must then be >= world_size. With ``shard=False`` every rank gets the
    whole batch (same update, world_size times the compute; for replicated setups). While
    rank 0 waits for items it broadcasts a keep-alive every ``block_ms`` and all ranks
    all-reduce their stop flags, so a SIGTERM on any rank stops all of them at the same
    point (``next_batch`` raises :class:`SourceStopped` everywhere) and no collective waits
    long enough to hit the process-group timeout.

    Idle work. While no batch is ready, ``next_batch`` raises :class:`SourceIdle` on every
    rank at the same point once every ``idle_every_s`` seconds (rank 0's clock decides), so
    the caller may run collective work and call again (the Trainer runs ``hooks.on_idle``: the
    learner republishes its weights when an inference replica came back on older ones)."""

    redis: Any
    keys: transport.Keys | None
    batch_size: int
    # rank 0: staleness and trainability, judged at batch formation (the Trainer hands over
    # its own when it is built: AdmittingBatchSource); an item with a problem is
    # dead-lettered ("unusable_item") and never reaches a step
    admission: Admission = field(default_factory=Admission)
    consumer: str = DEFAULT_CONSUMER
    block_ms: int = 1000
    shard: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stop_fn: Callable[[], bool] = lambda: False
    on_stale: Callable[[int], None] | None = None
    # every rank: ``next_batch`` raises SourceIdle after waiting this long without a batch
    # (None: never), so the loop's owner may run collective work meanwhile
    idle_every_s: float | None = None
    # rank 0: a pending entry re-read after this many deliveries is dead-lettered
    # ("max_deliveries") instead of trained: the learner stopped that often while holding it
    # (a step that raises on it would otherwise crash every restart). Its batch-mates, held
    # through the same stops, go with it. Trained entries inside the checkpoint are acked
    # as trained whatever their count.
    max_deliveries: int = 3
    # --- state (checkpointed via state_dict) ---
    last_committed_id: str | None = None
    items_trained: int = 0
    stale_dropped: int = 0
    recovered_acked: int = 0  # pending entries <= last_committed_id acked on resume
    _replay_cursor: str | None = field(default="0", init=False)  # None: reading ">"
    _buffer: list[tuple[transport.Entry, SAWItem]] = field(default_factory=list, init=False)
    _handed: list[tuple[str, str]] = field(default_factory=list, init=False)  # (entry id, item id)
    _uncommitted: list[str] = field(default_factory=list, init=False)
    _max_trained_id: str | None = field(default=None, init=False)
    _resume_acked: set[str] | None = field(default=None, init=False)  # see load_state_dict
    _sc: transport.StreamConsumer | None = field(default=None, init=False)
    _last_seen: str | None = field(default=None, init=False)
    _read_errors: int = field(default=0, init=False)
    last_read: float = field(default=0.0, init=False)  # monotonic time of the last read attempt
    _idle_since: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"PipelineBatchSource.batch_size={self.batch_size} must be >= 1")
        if self.idle_every_s is not None and self.idle_every_s <= 0:
            raise ValueError(f"PipelineBatchSource.idle_every_s={self.idle_every_s} must be > 0")
        if self.max_deliveries < 1:
            raise ValueError(
                f"PipelineBatchSource.max_deliveries={self.max_deliveries} must be >= 1"
            )
        world = dist.get_world_size() if _dist() else 1
        if self.shard and self.batch_size < world:
            raise ValueError(
                f"batch_size={self.batch_size} < world_size={world}: every rank needs a non-empty "
                "shard; raise batch_size or run fewer ranks"
            )
        self.rank = dist.get_rank() if _dist() else 0
        self.world = world
        if self.rank == 0:
            if self.redis is None or self.keys is None:
                raise ValueError("PipelineBatchSource on rank 0 needs redis and keys")
            self._sc = accounting.AccountedConsumer(
                self.redis,
                self.keys.saw,
                transport.GROUP_LEARNER,
                self.consumer,
                self.keys.deadletter,
                stage="saw",
                max_deliveries=self.max_deliveries,
            )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Position after the last trained batch (saved in checkpoints; JSON-able)."""
        last = self._max_trained_id or self.last_committed_id
        return {
            "last_committed_id": last,
            "trained_unacked": list(self._uncommitted),
            "items_trained": self.items_trained,
            "stale_dropped": self.stale_dropped,
            "consumer": self.consumer,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (stored by ``Trainer.save_checkpoint`` in the
        checkpoint's extra): ``last_committed_id`` (the largest stream id of any trained
        item) and ``trained_unacked``, the entry ids trained but not acked when it was taken,
        i.e. exactly the entries inside the checkpoint that may still be pending.

        After ``--resume``, a pending entry in ``trained_unacked`` (the process died between
        saving the checkpoint and acking) is acked without training, and every other pending
        entry is retrained, in stream order. Ids are not enough: a reply to XREADGROUP lost
        on the wire and retried by the client leaves older entries pending unseen behind
        newer trained ones; they are trained on resume, never acked as trained. (A
        checkpoint without ``trained_unacked`` falls back to acking every pending id <=
        ``last_committed_id``.)"""
        self.last_committed_id = sd.get("last_committed_id")
        unacked = sd.get("trained_unacked")
        self._resume_acked = None if unacked is None else {str(x) for x in unacked}
        self._max_trained_id = self.last_committed_id
        self.items_trained = int(sd.get("items_trained", 0))
        self.stale_dropped = int(sd.get("stale_dropped", 0))
        if sd.get("consumer") not in (None, self.consumer):
            log.warning(
                "checkpoint was written by consumer %r, this learner reads as %r: entries "
                "pending on %r are not re-read; keep the consumer name stable across restarts",
                sd.get("consumer"),
                self.consumer,
                sd.get("consumer"),
            )

    @property
    def uncommitted(self) -> int:
        """Trained entries not acked yet."""
        return len(self._uncommitted)

    # ------------------------------------------------------------------ rank-0 reading

    async def start(self) -> None:
        """Create the consumer group if needed and restart reading at this consumer's own
        pending entries (rank 0; a no-op elsewhere).

        The consumer's name is stable (``learner-0`` by default, the same across restarts):
        it first re-reads its own pending entries (``XREADGROUP ... 0``, stream order), then
        new ones (``>``). Stale claiming (XAUTOCLAIM) is deliberately *not* used: the
        learner's own pending entries are items it trained but has not committed yet, and
        claiming them back would train them twice."""
        if self.rank != 0:
            return
        assert self._sc is not None
        await self._sc.ensure_group()
        self._replay_cursor = "0"

    def _committed(self, eid: str) -> bool:
        """A pending entry already inside the checkpoint this learner resumed from."""
        if self._resume_acked is not None:
            return eid in self._resume_acked
        return self.last_committed_id is not None and stream_id_key(eid) <= stream_id_key(
            self.last_committed_id
        )

    async def _read(self, count: int) -> list[transport.Entry]:
        self.last_read = time.monotonic()
        assert self.keys is not None
        stream = self.keys.saw
        start = ">" if self._replay_cursor is None else self._replay_cursor
        assert self._sc is not None
        try:
            out, ids = await self._sc.read_own(
                start, count, None if self._replay_cursor is not None else self.block_ms
            )
        except transport.REDIS_DOWN_ERRORS as e:
            # A lost XREADGROUP '>' reply may have moved entries into our PEL unseen: re-read
            # our pending entries after the last one we saw, then go on with '>'.
            log.warning("redis unavailable while reading %s (%s); retrying", stream, e)
            self._replay_cursor = self._last_seen or "0"
            await transport.backoff_sleep(self._read_errors)
            self._read_errors += 1
            return []
        except Exception as e:  # NOGROUP: redis restarted without persistence
            if "NOGROUP" not in str(e):
                raise
            log.warning("group %s on %s missing; recreating", transport.GROUP_LEARNER, stream)
            assert self._sc is not None
            await self._sc.ensure_group()
            return []
        self._read_errors = 0
        for eid_s in ids:  # (entries deleted while pending were acked by read_own)
            if self._last_seen is None or stream_id_key(eid_s) > stream_id_key(self._last_seen):
                self._last_seen = eid_s
            if self._replay_cursor is not None:
                self._replay_cursor = eid_s
        if self._replay_cursor is not None and not ids:
            log.info("re-read all pending entries of %s; reading new ones", self.consumer)
            self._replay_cursor = None
        return out

    async def _read_into_buffer(self) -> bool:
        """One read of at most the missing items into the buffer (decoded; an undecodable or
        untrainable entry is dead-lettered); False when it came back empty."""
        assert self._sc is not None
        entries = await self._read(self.batch_size - len(self._buffer))
        if not entries:
            # replaying pending entries: an empty read moved on to new ones; read again
            return self._replay_cursor is not None and not self._read_errors
        recovered = [e for e in entries if self._committed(e.id)]
        fresh = [e for e in entries if not self._committed(e.id)]
        if fresh and self._replay_cursor is not None:
            # re-read pending entries (the read that found them set the cursor): every
            # re-read is a delivery, and too many mean they were held through as many stops
            fresh = await self._sc.under_delivery_limit(fresh)
        for e in fresh:
            try:
                item = transport.decode_saw_item(e.payload)
            except transport.CodecError as err:
                await self._sc.dead_letter(e, err.reason, err.detail)
                continue
            if not item.item_id:
                item.meta["item_id"] = e.item_id or e.id
            problem = self.admission.problem(item)
            if problem is not None:
                log.warning("dead-lettering SAW item %s: %s", item.item_id, problem)
                await self._sc.dead_letter(e, "unusable_item", problem)
                continue
            self._buffer.append((e, item))
        if recovered:
            # already inside the checkpoint: trained (libludic.transport.accounting counts them now)
            await accounting.ack_items(self._sc, [e.id for e in recovered], "trained")
            self.recovered_acked += len(recovered)
            log.info("acked %d pending entries already in the checkpoint", len(recovered))
        return True

    async def _drop_stale(self) -> None:
        """Ack and count the buffered items stale at the served version now (the one place
        this source judges staleness: at batch formation, so the Trainer never gets an item
        it would drop)."""
        if not self._buffer:
            return
        self._buffer, stale = self.admission.split_stale(self._buffer, lambda b: b[1])
        if stale:
            assert self._sc is not None
            await accounting.ack_items(self._sc, [e.id for e, _ in stale], "stale")
            self.stale_dropped += len(stale)
            if self.on_stale is not None:
                self.on_stale(len(stale))

    async def _take_batch_rank0(self) -> list[tuple[transport.Entry, SAWItem]] | None:
        """Read until ``batch_size`` fresh items are buffered or a read came back empty (it
        blocks up to ``block_ms``); the batch if complete, else None."""
        while True:
            await self._drop_stale()
            if len(self._buffer) >= self.batch_size:
                batch = self._buffer[: self.batch_size]
                self._buffer = self._buffer[self.batch_size :]
                return batch
            if not await self._read_into_buffer():
                return None

    # ------------------------------------------------------------------ BatchSource

    async def next_batch(self) -> SAWBatch:
        """The next macro-batch (this rank's shard of it when sharding across ranks).

        Freshness (the Admission's ``max_lag``) is judged at batch formation, over the items
        read so far; stale items are acked at once, counted in ``stale_dropped`` (the
        caller exports ``ludic_learner_stale_dropped_total``) and never trained.
        Undecodable entries go to the dead-letter stream."""
        if self._handed:
            raise RuntimeError(
                "next_batch() called before mark_trained() for the previous batch; call "
                "mark_trained() once the step that used it finished"
            )
        while True:
            batch: list[tuple[transport.Entry, SAWItem]] | None = None
            idle = False
            if self.rank == 0:
                batch = await self._take_batch_rank0()
                idle = batch is None and self._idle_due()
            if not _dist():
                if batch is not None:
                    return self._hand_out(batch, [it for _, it in batch])
                if self.stop_fn():
                    raise SourceStopped()
                if idle:
                    raise SourceIdle()
                continue
            # every rank: rank 0 tells whether a batch is ready (payloads), to keep waiting,
            # or that the wait has been long enough for idle work (SourceIdle on every rank)
            msg: bytes | None = None
            if self.rank == 0:
                if batch is None:
                    msg = msgpack.packb({"k": _MSG_IDLE if idle else _MSG_WAIT})
                else:
                    msg = msgpack.packb(
                        {
                            "k": _MSG_BATCH,
                            "items": [e.payload for e, _ in batch],
                            "ids": [it.item_id for _, it in batch],
                        },
                        use_bin_type=True,
                    )
            got = msgpack.unpackb(broadcast_bytes(msg, self.device), raw=False, strict_map_key=True)
            if got["k"] in (_MSG_WAIT, _MSG_IDLE):
                if any_rank(self.stop_fn(), self.device):
                    raise SourceStopped()
                if got["k"] == _MSG_IDLE:
                    raise SourceIdle()
                await asyncio.sleep(0)
                continue
            payloads: list[bytes] = got["items"]
            if self.shard:
                lo, hi = shard_bounds(len(payloads), self.world, self.rank)
            else:
                lo, hi = 0, len(payloads)
            if self.rank == 0:
                assert batch is not None
                mine = [it for _, it in batch[lo:hi]]
                return self._hand_out(batch, mine)
            items = []
            for p, iid in zip(payloads[lo:hi], got["ids"][lo:hi], strict=True):
                it = transport.decode_saw_item(p)
                it.meta.setdefault("item_id", iid)
                if not it.item_id:
                    it.meta["item_id"] = iid
                items.append(it)
            self._handed = [("", i) for i in got["ids"]]
            return SAWBatch(items=items, meta={"batch_item_ids": list(got["ids"])})

    def _idle_due(self) -> bool:
        """Rank 0, no batch ready: has the wait lasted ``idle_every_s`` since it began or
        since the last SourceIdle?"""
        if self.idle_every_s is None:
            return False
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
            return False
        if now - self._idle_since < self.idle_every_s:
            return False
        self._idle_since = now
        return True

    def _hand_out(
        self, batch: Sequence[tuple[transport.Entry, SAWItem]], mine: list[SAWItem]
    ) -> SAWBatch:
        self._handed = [(e.id, it.item_id) for e, it in batch]
        self._idle_since = None
        return SAWBatch(items=mine, meta={"batch_item_ids": [it.item_id for _, it in batch]})

    # ------------------------------------------------------------------ commit

    def mark_trained(self) -> list[str]:
        """The batch handed out last was trained (its step finished). Returns its item ids
        (of the whole batch, every rank). Call it after ``Trainer.train_step``: it moves the
        batch to the trained-but-uncommitted list that :meth:`commit` acks."""
        ids = [iid for _, iid in self._handed]
        if self.rank == 0:
            eids = [eid for eid, _ in self._handed]
            self._uncommitted.extend(eids)
            for eid in eids:
                if self._max_trained_id is None or stream_id_key(eid) > stream_id_key(
                    self._max_trained_id
                ):
                    self._max_trained_id = eid
        self.items_trained += len(ids)
        self._handed = []
        return ids

    async def commit(self) -> int:
        """Ack every trained entry (call once the steps that used them are committed).

        The service calls it after every step when checkpointing is off, and right after a
        checkpoint is saved when it is on (so an item is acked iff it is inside a saved
        checkpoint)."""
        if self.rank != 0 or not self._uncommitted:
            self._uncommitted = []
            return 0
        assert self._sc is not None and self.keys is not None
        ids, n = list(self._uncommitted), len(self._uncommitted)
        sc = self._sc
        for i in range(0, n, 1000):
            chunk = ids[i : i + 1000]
            await transport.retry_redis(
                functools.partial(accounting.ack_items, sc, chunk, "trained"),
                deadline_s=60,
                should_stop=self.stop_fn,
            )
        self._uncommitted = []
        self.last_committed_id = self._max_trained_id
        return n
