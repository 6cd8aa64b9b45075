"""Learner side of the two weight planes of ``ludic inference`` (see services/inference/README.md).

HTTP plane: ``push_http(url, state_dict, version, token)`` serialises the state dict to
safetensors bytes (HF parameter names) and POSTs them to ``/v1/weights?version=N``; a LoRA
adapter goes to ``/v1/adapter?version=N`` (:data:`ADAPTER_ROUTE`, body and metadata:
:func:`adapter_metadata`).

Collective plane: ``CollectiveWeightSender`` builds a process group that is *separate* from
the learner's default one (its own TCPStore + ``ProcessGroupGloo``, or vLLM's
``PyNcclCommunicator`` over a ``StatelessProcessGroup`` for NCCL). The learner's rank 0 is
rank 0 of that group; the other ranks are the replicas' vLLM workers (vLLM's weight-transfer
engine ``ludic``, services/inference/weight_transfer.py): replica ``i`` runs ``n_i`` workers
(``GET /v1/weights/collective`` -> ``workers``: tensor x pipeline parallel) at ranks
``r_i .. r_i + n_i - 1``, ``r_0 = 1``, ``r_{i+1} = r_i + n_i``. One update is a round: every
replica validates the metadata and acks, the learner stores go (or abort) and broadcasts
the tensors, the workers receive them and the replica loads them in one pause (the
sequence, key by key: DEVELOPERS.md, "Inference service HTTP API", collective round).

A replica that rejects the metadata never enters the broadcast, so the learner aborts the
round instead of hanging. Control keys travel through the group's TCPStore as plain strings
(no pickle); :func:`ack_key` and its siblings name them.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from safetensors.torch import save
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore  # type: ignore[attr-defined]

# torch dtype <-> the names used on the wire (torch's own spelling, without "torch.").
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in WIRE_DTYPES.items()}

WEIGHTS_ROUTE = "/v1/weights"
ADAPTER_ROUTE = "/v1/adapter"
#: safetensors ``__metadata__`` key of an adapter body: its peft adapter_config.json (JSON)
ADAPTER_CONFIG_KEY = "ludic_adapter_config"
#: the prefix of an adapter body's tensor names: peft's for a causal LM
#: (``base_model.model.<module>.lora_A.weight``, as in its ``adapter_model.safetensors``)
PEFT_PREFIX = "base_model.model."

ACK_OK = "ok"
GO = "go"
ABORT = "abort"
#: a worker's recvd/{round}/{rank} after an aborted round (it never entered the broadcast)
ABORTED = "aborted"
#: prefixes of a refusal in recvd/{round}/{rank}: the update does not fit (422), the
#: transfer itself failed (502)
REJECTED = "rejected: "
FAILED = "error: "


def ack_key(rnd: int, rank: int) -> str:
    """A replica's answer to round ``rnd`` (``ok`` or the reason), under its first rank."""
    return f"ack/{rnd}/{rank}"


def go_key(rnd: int) -> str:
    """The learner's decision for round ``rnd``: :data:`GO` or :data:`ABORT`."""
    return f"go/{rnd}"


def joined_key(rank: int) -> str:
    """A worker's join of the group: ``ok`` or ``error: ...``."""
    return f"joined/{rank}"


def recvd_key(rnd: int, rank: int) -> str:
    """A worker's receive of round ``rnd``: ``ok``, :data:`ABORTED`, ``rejected: ...`` or
    ``error: ...``."""
    return f"recvd/{rnd}/{rank}"


def applied_key(rnd: int, rank: int) -> str:
    """Seconds a worker took to load round ``rnd`` into the served weights (repr of a float)."""
    return f"applied/{rnd}/{rank}"


class WeightSyncError(RuntimeError):
    """A replica refused an update (carries the HTTP status and the server's reason)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _full_tensor(t: Any) -> torch.Tensor:
    # FSDP2 DTensor shards gather with full_tensor(); plain tensors pass through.
    full = getattr(t, "full_tensor", None)
    out = full() if callable(full) else t
    detached: torch.Tensor = out.detach()
    return detached


def cast_floats(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` if it is floating and ``dtype`` is given, else ``t`` unchanged."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def to_safetensors_bytes(
    state_dict: Mapping[str, Any],
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """HF-named state dict -> safetensors bytes (contiguous CPU copies; tied tensors split).
    ``dtype``: floating tensors are cast to it first (the replica's served dtype halves the
    bytes of an fp32 learner publishing to a bf16 server). ``metadata``: the header's
    ``__metadata__`` (strings only)."""
    flat = {
        k: cast_floats(_full_tensor(v).to("cpu"), dtype).contiguous().clone()
        for k, v in state_dict.items()
    }
    return save(flat, dict(metadata) if metadata else None)


def adapter_metadata(config: Mapping[str, Any]) -> dict[str, str]:
    """safetensors metadata carrying a LoRA adapter's peft config (:data:`ADAPTER_CONFIG_KEY`).

    An adapter (peft names, ``lora_A``/``lora_B`` only) is sent to ``/v1/adapter?version=N``
    (:data:`ADAPTER_ROUTE`) as the same safetensors body as full weights, its peft adapter
    config (``r``, ``lora_alpha``, ``target_modules``) as JSON under
    :data:`ADAPTER_CONFIG_KEY` in the safetensors metadata."""
    return {ADAPTER_CONFIG_KEY: json.dumps(dict(config), sort_keys=True)}


def _raise_for_reply(url: str, resp: httpx.Response) -> None:
    if resp.status_code == 200:
        return
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        detail = resp.text
    raise WeightSyncError(f"{url}: HTTP {resp.status_code}: {detail}", resp.status_code)


def push_http(
    url: str,
    state_dict: Mapping[str, Any],
    version: int,
    token: str | None,
    timeout_s: float = 600.0,
) -> int:
    """POST ``state_dict`` (safetensors bytes) to ``{url}/v1/weights?version=N``.

    Returns the policy version the replica now serves (== ``version``); raises
    ``WeightSyncError`` (with ``.status``: 401/403/409/4xx/5xx) when it refuses.
    """
    resp = post_weights(url, to_safetensors_bytes(state_dict), version, token, timeout_s)
    _raise_for_reply(url.rstrip("/"), resp)
    return int(resp.json()["policy_version"])


def post_weights(
    url: str,
    body: bytes,
    version: int,
    token: str | None,
    timeout: float | httpx.Timeout,
    client: httpx.Client | None = None,
    route: str = WEIGHTS_ROUTE,
) -> httpx.Response:
    """One ``POST {url}/v1/weights?version=N`` of safetensors ``body``: the one place the
    HTTP weight plane is spoken (``push_http`` and the learner's ``HttpPolicyPublisher``,
    which adds retries and 409 resolution, both call it). Returns the raw response.
    ``route``: :data:`ADAPTER_ROUTE` for a LoRA adapter body.

    ``client``: a long-lived ``httpx.Client`` to send with (its connections are reused). A
    caller that publishes repeatedly should pass one: without it each call builds a client,
    whose TLS context alone costs ~15 ms of CPU, taken from the training process's core.

    The body goes out in :data:`SEND_CHUNK` slices of one buffer (and its Content-Length),
    never as one ``bytes``: httpcore sends a ``bytes`` body by slicing off what each
    ``send`` took, a copy of the rest every time, quadratic in the size (a 538 MB body took
    17 s on loopback, 0.97 s in 1 MiB slices: ``python bench/weights.py --model DIR``)."""
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(body))}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return (client or httpx).post(
        f"{url.rstrip('/')}{route}",
        params={"version": int(version)},
        content=_slices(body),
        headers=headers,
        timeout=timeout,
    )


SEND_CHUNK = 1 << 20


def _slices(body: bytes) -> Iterator[bytes]:
    view = memoryview(body)
    for i in range(0, len(view), SEND_CHUNK):
        yield bytes(view[i : i + SEND_CHUNK])


# --------------------------------------------------------------------------- groups


def _local_address_towards(host: str, port: int) -> str:
    """The local IP the kernel would use to reach ``host`` (gloo must bind to it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return str(s.getsockname()[0])
        except OSError:
            return host


@dataclass
class WeightGroup:
    """One rank of the weight-broadcast group; ``broadcast(t, src=0)`` in place."""

    rank: int
    world_size: int
    backend: str
    store: Any  # torch.distributed.Store used for the control keys
    device: torch.device
    _pg: Any = None
    _comm: Any = None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.backend == "gloo":
            self._pg.broadcast(tensor, src).wait()
        else:
            stream = torch.cuda.current_stream(self.device)  # a receiver's side stream
            self._comm.broadcast(tensor, src=src, stream=stream)
            stream.synchronize()

    def close(self) -> None:
        self._pg = None
        self._comm = None
        self.store = None


def open_store(
    master_address: str,
    master_port: int,
    timeout_s: float,
    world_size: int | None = None,
    is_master: bool = False,
) -> Any:
    """The weight group's TCPStore: hosted by the learner (``is_master``), a client anywhere
    else (a worker, or a replica's API server that only writes and reads control keys).
    A client retries the connection until ``timeout_s``."""
    return TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=is_master,
        timeout=_dt.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_group(
    store: Any,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    device: torch.device | None = None,
) -> WeightGroup:
    """Join the weight-broadcast group over ``store``; blocks until every rank joined.

    Never touches torch.distributed's default group, so it can live next to the learner's
    FSDP2 group. gloo binds to the interface that routes to ``master_address`` (or
    ``GLOO_SOCKET_IFNAME`` if set). nccl: ``device`` (default the current CUDA device) is
    made current in the calling thread, which may be a worker's background thread.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    if backend == "gloo":
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        if ifname:
            dev = ProcessGroupGloo.create_device(interface=ifname)
        else:
            host = (
                master_address if rank == 0 else _local_address_towards(master_address, master_port)
            )
            dev = ProcessGroupGloo.create_device(hostname=host)
        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dev]
        opts._timeout = _dt.timedelta(seconds=timeout_s)
        pg = ProcessGroupGloo(PrefixStore("ludic/gloo", store), rank, world_size, opts)
        return WeightGroup(rank, world_size, backend, store, torch.device("cpu"), _pg=pg)

    if not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs a CUDA device on this process; use 'gloo'")
    # vLLM's own NCCL machinery: PyNcclCommunicator over a StatelessProcessGroup that shares
    # our TCPStore (under a prefix), so it never touches the default process group. vLLM
    # is imported here: the library runs without it, and only this NCCL plane needs it.
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)  # the CUDA device is per thread
    spg = StatelessProcessGroup(
        rank=rank, world_size=world_size, store=PrefixStore("ludic/nccl", store)
    )
    try:  # vLLM pins NCCL_* in its workers; a communicator shared with the learner must not
        from vllm.utils.nccl import unpinned_nccl_env
    except ImportError:
        comm = PyNcclCommunicator(spg, device=device)
    else:
        with unpinned_nccl_env():
            comm = PyNcclCommunicator(spg, device=device)
    return WeightGroup(rank, world_size, backend, store, device, _comm=comm)


def open_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float = 300.0,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) the weight-broadcast group; blocks until all joined
    (:func:`open_store` then :func:`join_group`)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    store = open_store(master_address, master_port, timeout_s, world_size, is_master=rank == 0)
    return join_group(store, master_address, master_port, rank, world_size, backend, timeout_s)


def wait_key(store: Any, key: str, timeout_s: float, poll_s: float = 0.005) -> str:
    """Block until ``key`` exists in ``store`` and return its value (str)."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {key!r} in the weight-group store after {timeout_s:.0f} s")
        time.sleep(poll_s)
    return bytes(store.get(key)).decode()


def wait_keys(store: Any, keys: Sequence[str], timeout_s: float) -> list[str]:
    """:func:`wait_key` for each of ``keys`` (one deadline for all); their values."""
    deadline = time.monotonic() + timeout_s
    return [wait_key(store, k, max(0.0, deadline - time.monotonic())) for k in keys]


# --------------------------------------------------------------------------- sender


@dataclass
class CollectiveWeightSender:
    """Rank 0 of the weight-broadcast group, talking to one or more inference replicas.

    ``init()`` asks every replica how many vLLM workers it runs
    (``GET /v1/weights/collective``), gives replica ``i`` the ranks from ``offsets[i]``
    (module docstring), then performs the HTTP handshake (POST /v1/weights/collective/init
    to every replica while hosting the group as rank 0); ``send(state_dict, version)`` runs
    one round and returns the version every replica now serves.
    """

    urls: Sequence[str]
    master_address: str
    master_port: int
    token: str | None = None
    backend: str = "gloo"
    timeout_s: float = 600.0
    group: WeightGroup | None = None
    workers: list[int] = field(default_factory=list)  # vLLM workers of each replica
    offsets: list[int] = field(default_factory=list)  # first rank of each replica
    _round: int = 0
    _http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=None))

    @property
    def world_size(self) -> int:
        """1 + every replica's workers (known after ``init``)."""
        return 1 + sum(self.workers)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _post(self, url: str, path: str, **kw: Any) -> httpx.Response:
        return self._http.post(
            url.rstrip("/") + path, headers=self._headers(), timeout=self.timeout_s, **kw
        )

    def _workers_of(self, url: str) -> int:
        resp = self._http.get(
            url.rstrip("/") + "/v1/weights/collective",
            headers=self._headers(),
            timeout=min(self.timeout_s, 30.0),
        )
        _raise_for_reply(url.rstrip("/"), resp)
        return int(resp.json()["workers"])

    def init(self) -> None:
        if self.group is not None:
            raise RuntimeError("CollectiveWeightSender.init() called twice")
        with cf.ThreadPoolExecutor(max(1, len(self.urls))) as pool:
            self.workers = list(pool.map(self._workers_of, self.urls))
            self.offsets = [1 + sum(self.workers[:i]) for i in range(len(self.urls))]
            futs = [
                pool.submit(
                    self._post,
                    url,
                    "/v1/weights/collective/init",
                    json={
                        "master_address": self.master_address,
                        "master_port": self.master_port,
                        "world_size": self.world_size,
                        "backend": self.backend,
                        "rank": self.offsets[i],
                    },
                )
                for i, url in enumerate(self.urls)
            ]
            try:
                self.group = open_weight_group(
                    self.master_address,
                    self.master_port,
                    0,
                    self.world_size,
                    self.backend,
                    timeout_s=self.timeout_s,
                )
            except Exception:
                # A replica refused (e.g. 401): surface its reason rather than the timeout.
                for url, f in zip(self.urls, futs):
                    if f.done() and f.exception() is None:
                        _raise_for_reply(url, f.result())
                raise
            for url, f in zip(self.urls, futs):
                _raise_for_reply(url, f.result())

    def send(self, state_dict: Mapping[str, Any], version: int) -> int:
        if self.group is None:
            raise RuntimeError("call CollectiveWeightSender.init() before send()")
        group = self.group
        tensors = {k: _full_tensor(v).to(group.device).contiguous() for k, v in state_dict.items()}
        names: list[str] = list(tensors)
        for n in names:
            if tensors[n].dtype not in DTYPE_NAMES:
                raise ValueError(f"{n}: dtype {tensors[n].dtype} cannot be sent")
        meta = {
            "names": names,
            "dtypes": [DTYPE_NAMES[tensors[n].dtype] for n in names],
            "shapes": [list(tensors[n].shape) for n in names],
            "round": self._round + 1,
        }
        self._round += 1
        rnd = self._round
        store = group.store
        with cf.ThreadPoolExecutor(max(1, len(self.urls))) as pool:
            futs = [
                pool.submit(
                    self._post,
                    url,
                    "/v1/weights/collective/update",
                    params={"version": int(version)},
                    content=json.dumps(meta).encode(),
                )
                for url in self.urls
            ]
            refusals = self._collect_acks(rnd, futs)
            store.set(go_key(rnd), ABORT if refusals else GO)
            if refusals:
                for f in futs:
                    f.result()
                raise WeightSyncError("; ".join(refusals), _first_status(futs))
            for n in names:
                group.broadcast(tensors[n], src=0)
            for url, f in zip(self.urls, futs):
                _raise_for_reply(url, f.result())
            return int(futs[0].result().json()["policy_version"]) if futs else int(version)

    def _collect_acks(self, rnd: int, futs: list[cf.Future[Any]]) -> list[str]:
        """Wait until every replica acked round ``rnd`` or answered; return refusals."""
        store = self.group.store if self.group else None
        assert store is not None
        pending = set(range(len(self.urls)))
        refusals: list[str] = []
        deadline = time.monotonic() + self.timeout_s
        while pending:
            for i in list(pending):
                key = ack_key(rnd, self.offsets[i])
                if store.check([key]):
                    val = bytes(store.get(key)).decode()
                    if val != ACK_OK:
                        refusals.append(f"{self.urls[i]}: {val}")
                    pending.discard(i)
                elif futs[i].done():
                    exc = futs[i].exception()
                    if exc is not None:
                        refusals.append(f"{self.urls[i]}: {exc!r}")
                    else:
                        r = futs[i].result()
                        refusals.append(f"{self.urls[i]}: HTTP {r.status_code}: {r.text}")
                    pending.discard(i)
            if time.monotonic() > deadline:
                refusals.append(f"no answer from {[self.urls[i] for i in pending]}")
                break
            if pending:
                time.sleep(0.005)
        return refusals

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._http.close()


def _first_status(futs: list[cf.Future[Any]]) -> int | None:
    for f in futs:
        if f.done() and f.exception() is None and f.result().status_code != 200:
            return int(f.result().status_code)
    return None
