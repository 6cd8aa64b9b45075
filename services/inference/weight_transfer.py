"""vLLM weight-transfer engine ``ludic``: each vLLM worker is a rank of the learner's weight group.

Registered in vLLM's ``WeightTransferEngineFactory`` by ``vllm_plugin.register()`` (every vLLM
process) and enabled by ``--weight-transfer-config '{"backend": "ludic"}'``
(``LudicEngine.start``). vLLM builds one per worker (``Worker.load_model``); the API server
drives it with ``AsyncLLM.init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``, each a ``collective_rpc`` the EngineCore
serves between two scheduler steps (services/inference/collective.py). The tensors are
broadcast from the learner straight into this process: no serialised bytes, no staging file.

Worker ``w`` of a replica whose first rank is ``rank_offset`` is rank ``rank_offset + w``
(:class:`LudicTransferEngine`: ranks and backends).

Phases (store keys: ``weight_sync.*_key``)::

    init_transfer_engine      join the group from a thread (the EngineCore is not held for
                              the rendezvous); joined/{rank} = ok | error: ...
    update_weights recv       a thread waits for go/{round}, receives every tensor into fresh
                              buffers, casts floats to the served dtype, checks finiteness;
                              recvd/{round}/{rank} = ok | aborted | rejected: ... | error: ...
                              Returns at once: generation goes on during the transfer.
    update_weights apply      load the received round into the served weights (the only
                              pause: ``worker_ext.load_in_place``); applied/{round}/{rank}
    update_weights discard    drop the round (a refused or aborted one; a thread still
                              receiving drops its buffers when it ends)

``start_weight_update`` / ``finish_weight_update`` have nothing to do: a round is loaded by
one ``apply`` RPC, so no scheduler step ever sees a half-loaded model.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from libludic.distributed.weight_sync import (
    ABORTED,
    ACK_OK,
    FAILED,
    GO,
    REJECTED,
    WIRE_DTYPES,
    WeightGroup,
    applied_key,
    go_key,
    join_group,
    joined_key,
    open_store,
    recvd_key,
    wait_key,
)
from services.inference.validation import WeightValidationError, check_finite

log = logging.getLogger("ludic.inference")

PHASES = ("recv", "apply", "discard")
GROUP_BACKENDS = ("gloo", "nccl")


@dataclass
class LudicInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s info: the learner's group and this replica's ranks."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int  # the replica's first rank; the learner is rank 0
    backend: str = "gloo"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.master_address:
            raise ValueError("master_address is empty")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} outside 1..65535")
        if self.backend not in GROUP_BACKENDS:
            raise ValueError(f"backend {self.backend!r}: use one of {list(GROUP_BACKENDS)}")
        if self.rank_offset < 1:
            raise ValueError(f"rank_offset {self.rank_offset} must be >= 1 (the learner is 0)")
        if self.world_size <= self.rank_offset:
            raise ValueError(
                f"world_size {self.world_size} leaves no rank for rank_offset {self.rank_offset}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s {self.timeout_s} must be > 0")


@dataclass
class LudicUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``' info: one phase of round ``round`` (module docstring)."""

    phase: str
    round: int
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)  # torch spelling, weight_sync.WIRE_DTYPES
    shapes: list[list[int]] = field(default_factory=list)
    skip: list[str] = field(default_factory=list)  # received, not loaded (a tied lm_head)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase {self.phase!r}: use one of {list(PHASES)}")
        if self.round < 0:
            raise ValueError(f"round {self.round} must be >= 0")
        n = len(self.names)
        if len(self.dtypes) != n or len(self.shapes) != n:
            raise ValueError(
                f"names/dtypes/shapes must have equal lengths, got {n}/{len(self.dtypes)}/"
                f"{len(self.shapes)}"
            )
        if self.phase == "recv" and not n:
            raise ValueError("a recv phase names at least one tensor")
        bad = sorted({d for d in self.dtypes if d not in WIRE_DTYPES})
        if bad:
            raise ValueError(f"unknown dtype(s) {bad}; use one of {sorted(WIRE_DTYPES)}")
        if any(d < 0 for s in self.shapes for d in s):
            raise ValueError("shapes must be non-negative")


@dataclass
class _Round:
    """One round's receive, filled by its thread; read by ``apply`` once it ended."""

    info: LudicUpdateInfo
    group: WeightGroup
    thread: threading.Thread | None = None
    status: str = ""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: bool = False  # discarded while receiving: the thread drops what it got


class LudicTransferEngine(WeightTransferEngine[LudicInitInfo, LudicUpdateInfo]):
    """The worker end of the collective weight plane (module docstring).

    Ranks: worker ``w`` (``dp_index * world_size + rank``, as vLLM's own NCCL engine counts)
    of a replica whose first rank is ``rank_offset`` is rank ``rank_offset + w``. Backend:
    ``gloo`` (any device; on a GPU the tensors arrive in host memory and are copied in by
    the load) or ``nccl`` (vLLM's ``PyNcclCommunicator``, CUDA workers, on a side stream so
    the model's stream keeps running), both through ``weight_sync.join_group``.
    """

    init_info_cls = LudicInitInfo
    update_info_cls = LudicUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: WeightGroup | None = None
        self.rank = -1
        self.timeout_s = 600.0
        self.session = 0  # bumped by each init/shutdown: a join of an older one is dropped
        self.round: _Round | None = None
        self._mutex = threading.Lock()

    @property
    def worker_index(self) -> int:
        """This worker's index in the replica (vLLM's count: dp_index * TP*PP + rank)."""
        pc = self.parallel_config
        return int(pc.data_parallel_index) * int(pc.world_size) + int(pc.rank)

    # ------------------------------------------------------------------ init
    def init_transfer_engine(self, init_info: LudicInitInfo) -> None:
        rank = init_info.rank_offset + self.worker_index
        if rank >= init_info.world_size:
            raise ValueError(
                f"worker {self.worker_index} would be rank {rank}, outside world_size "
                f"{init_info.world_size}: count every vLLM worker of every replica"
            )
        if init_info.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend nccl needs a CUDA worker, this one is on {self.device}")
        self.shutdown()
        with self._mutex:
            session = self.session
        self.rank, self.timeout_s = rank, float(init_info.timeout_s)
        threading.Thread(
            target=self._join,
            args=(init_info, rank, session),
            name=f"ludic-weight-join-{rank}",
            daemon=True,
        ).start()

    def _join(self, info: LudicInitInfo, rank: int, session: int) -> None:
        try:
            store = open_store(info.master_address, info.master_port, info.timeout_s)
        except Exception as e:  # no store to report to: the API server's own wait times out
            log.error("rank %d: cannot reach the weight-group store: %s", rank, e)
            return
        try:
            device = self.device if info.backend == "nccl" else None
            group = join_group(
                store,
                info.master_address,
                info.master_port,
                rank,
                info.world_size,
                info.backend,
                info.timeout_s,
                device,
            )
        except Exception as e:
            store.set(joined_key(rank), f"{FAILED}{type(e).__name__}: {e}"[:2000])
            return
        with self._mutex:
            if session != self.session:  # re-initialised meanwhile
                group.close()
                return
            self.group = group
        store.set(joined_key(rank), ACK_OK)
        log.info("rank %d of the weight group (%s, world %d)", rank, info.backend, info.world_size)

    # ------------------------------------------------------------------ rounds
    def start_weight_update(self) -> None:
        """Nothing to prepare: ``apply`` loads a whole round in one RPC."""

    def finish_weight_update(self) -> None:
        """Nothing to finalise (see ``start_weight_update``)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One phase; no device-wide synchronisation after ``recv`` (vLLM's default), which
        would wait for the broadcast the phase just started."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: LudicUpdateInfo) -> None:
        if update_info.phase == "recv":
            self._start_receive(update_info)
        elif update_info.phase == "apply":
            self._apply(update_info.round)
        else:
            self._discard(update_info.round)

    def _start_receive(self, info: LudicUpdateInfo) -> None:
        with self._mutex:
            group = self.group
        if group is None:
            raise RuntimeError(
                f"rank {self.rank}: not in a weight group; POST /v1/weights/collective/init"
            )
        if self.round is not None:
            raise RuntimeError(f"round {self.round.info.round} was neither applied nor discarded")
        rnd = _Round(info, group)
        rnd.thread = threading.Thread(
            target=self._receive, args=(rnd,), name=f"ludic-weight-recv-{info.round}", daemon=True
        )
        self.round = rnd
        rnd.thread.start()

    def _receive(self, rnd: _Round) -> None:
        info, group = rnd.info, rnd.group
        try:
            if wait_key(group.store, go_key(info.round), self.timeout_s) != GO:
                status = ABORTED
            else:
                with self._side_stream():
                    for name, dt, shape in zip(info.names, info.dtypes, info.shapes):
                        t = torch.empty(tuple(shape), dtype=WIRE_DTYPES[dt], device=group.device)
                        group.broadcast(t, src=0)
                        rnd.tensors[name] = t
                    self._to_served(rnd.tensors)
                    check_finite(rnd.tensors)
                status = ACK_OK
        except WeightValidationError as e:
            status = f"{REJECTED}{e}"
        except Exception as e:  # the transfer itself failed (a peer died, a timeout)
            status = f"{FAILED}{type(e).__name__}: {e}"
        if status != ACK_OK or rnd.dropped:
            rnd.tensors = {}
        rnd.status = status
        with contextlib.suppress(Exception):  # a learner that died took its store along
            group.store.set(recvd_key(info.round, self.rank), status[:2000])

    def _side_stream(self) -> Any:
        """NCCL receives on a stream of their own: the model's stream keeps generating."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.Stream(self.device))

    def _to_served(self, tensors: dict[str, torch.Tensor]) -> None:
        """Floating tensors cast to the served dtype (the learner may send fp32 to bf16)."""
        served = self.model_config.dtype
        for name, t in tensors.items():
            if t.is_floating_point() and t.dtype != served:
                tensors[name] = t.to(served)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _apply(self, round_no: int) -> None:
        rnd = self.round
        if rnd is None or rnd.info.round != round_no:
            raise RuntimeError(f"rank {self.rank}: no received round {round_no} to apply")
        assert rnd.thread is not None
        rnd.thread.join(timeout=30.0)  # ended: its recvd key is what the API server waited for
        if rnd.thread.is_alive() or rnd.status != ACK_OK:
            raise RuntimeError(f"rank {self.rank}: round {round_no} not received ({rnd.status!r})")
        self.round = None
        # vLLM's loader and the worker extension: this module is imported by the plugin in
        # every vLLM process, these only in a worker applying a round
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        from services.inference.worker_ext import load_in_place

        t0 = time.perf_counter()
        skip = set(rnd.info.skip)
        weights = [(n, t) for n, t in rnd.tensors.items() if n not in skip]
        rnd.tensors = {}

        def layerwise(it: Iterator[tuple[str, torch.Tensor]]) -> None:
            reload_weights(self.vllm_config, self.model, it, None, True)

        load_in_place(self.model, self.vllm_config, weights, layerwise)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        del weights
        seconds = time.perf_counter() - t0
        rnd.group.store.set(applied_key(round_no, self.rank), repr(seconds))

    def _discard(self, round_no: int) -> None:
        rnd = self.round
        if rnd is None or rnd.info.round != round_no:
            return  # nothing of that round here (its receive never started)
        self.round = None
        rnd.dropped = True
        rnd.tensors = {}

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Leave the group (a thread still joining or receiving ends on its own)."""
        with self._mutex:
            self.session += 1
            group, self.group = self.group, None
        if self.round is not None:
            self._discard(self.round.info.round)
        if group is not None:
            group.close()
