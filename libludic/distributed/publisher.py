"""PolicyPublishers: make the learner's weights the served policy on every inference replica.

``publish(state_dict, version)`` returns only when **every** replica serves ``version`` and
raises :class:`PublishError` (naming each failed replica and why) otherwise. The replicas are
:class:`ReplicaSet`'s resolution of the base URLs (``LUDIC_INFERENCE_URLS``), done again on
every publish; every wait is bounded by a :class:`RetryPolicy`. What the *learner* does with
a failed publish (continue, count, stop after N in a row) is the service's policy
(services/learner/README.md, "Guarantees").

``on_result(replica, version_or_None, error_or_None)`` is called once per replica per
publish (for metrics / status); ``acked`` maps replica -> last acknowledged version.

Planes:

* :class:`HttpPolicyPublisher`: safetensors over ``POST /v1/weights?version=N`` (or a LoRA
  adapter to ``/v1/adapter``) to every replica in parallel.
* :class:`BroadcastPolicyPublisher`: HTTP control plane + collective data plane
  (``weight_sync.CollectiveWeightSender``: gloo on CPU, NCCL on GPU).

:class:`Rank0OnlyPublisher` lets every rank of a distributed Trainer call ``publish``; only
rank 0 sends.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import torch

from libludic.distributed import weight_sync as ws
from libludic.retry import Backoff

log = logging.getLogger(__name__)

ResultFn = Callable[[str, int | None, str | None], None]
Resolver = Callable[[str, int], list[str]]
_PERMANENT = {400, 401, 403, 413, 422}


class PublishError(RuntimeError):
    """Not every replica acknowledged ``version``; ``failures`` maps replica -> reason."""

    def __init__(self, version: int, failures: Mapping[str, str], acked: Sequence[str] = ()):
        self.version = version
        self.failures = dict(failures)
        self.acked = list(acked)
        detail = "; ".join(f"{u}: {why}" for u, why in self.failures.items())
        super().__init__(
            f"publish of policy version {version} failed on {len(self.failures)} replica(s) "
            f"({len(self.acked)} acknowledged): {detail}"
        )


# ---------------------------------------------------------------------------- replicas


def _default_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[str] = []
    for fam, _, _, _, sa in infos:
        if fam in (socket.AF_INET, socket.AF_INET6) and sa[0] not in out:
            out.append(str(sa[0]))
    return out


@dataclass
class ReplicaSet:
    """Base URLs -> replica URLs, re-resolved on every call of :meth:`resolve`.

    A URL whose host resolves to several addresses (a Kubernetes headless Service,
    ``docker compose --scale``) stands for one replica per address
    (``http://10.0.0.7:8000``); a host with one address, or an IP literal, is kept as
    written. The publishers resolve again on each publish, so replicas that come and go are
    followed.
    """

    urls: Sequence[str]
    resolver: Resolver = _default_resolver

    def __post_init__(self) -> None:
        self.urls = [u.strip().rstrip("/") for u in self.urls if u and u.strip()]
        for u in self.urls:
            p = urlsplit(u)
            if p.scheme not in ("http", "https") or not p.hostname:
                raise ValueError(
                    f"inference URL {u!r} is not an http(s) base URL; use e.g. "
                    "LUDIC_INFERENCE_URLS=http://inference:8000"
                )

    def resolve(self) -> list[str]:
        out: list[str] = []
        for u in self.urls:
            for r in self._expand(u):
                if r not in out:
                    out.append(r)
        return out

    def _expand(self, url: str) -> list[str]:
        p = urlsplit(url)
        host = p.hostname or ""
        try:
            ipaddress.ip_address(host)
            return [url]
        except ValueError:
            pass
        port = p.port or (443 if p.scheme == "https" else 80)
        try:
            addrs = self.resolver(host, port)
        except OSError as e:  # keep the name: the publish then fails with a clear reason
            log.warning("cannot resolve inference host %s (%s); using the URL as given", host, e)
            return [url]
        if len(addrs) <= 1:
            return [url]
        out = []
        for a in addrs:
            h = f"[{a}]" if ":" in a else a
            netloc = f"{h}:{p.port}" if p.port else h
            out.append(urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment)))
        return out


# ---------------------------------------------------------------------------- helpers


def _targets(pub: Any, version: int | None, who: str) -> tuple[int, list[str]]:
    """The version to publish and the replicas to publish it to (resolved now, remembered
    in ``pub.last_replicas``); an error when there is no version or no replica."""
    if version is None:
        raise ValueError(f"{who}.publish needs an explicit version")
    urls = pub.replicas.resolve()
    pub.last_replicas = urls
    if not urls:
        raise PublishError(int(version), {"<none>": "no inference replicas resolved"})
    return int(version), urls


@dataclass
class RetryPolicy:
    """How long a publish may wait for a replica: at most ``max_attempts`` tries with
    exponential backoff (``backoff_s`` doubling up to ``backoff_cap_s``), each attempt
    limited to ``attempt_timeout_s`` (connect: at most ``connect_timeout_s``) and the whole
    publish to ``total_timeout_s``; after that the replica counts as failed."""

    max_attempts: int = 3
    attempt_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    total_timeout_s: float = 300.0
    backoff_s: float = 0.5
    backoff_cap_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be >= 1")
        for name in ("attempt_timeout_s", "connect_timeout_s", "total_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        Backoff(self.backoff_s, self.backoff_cap_s)  # validates them

    def delay(self, attempt: int) -> float:
        """Seconds before the attempt after ``attempt`` (1-based): backoff_s doubling."""
        return Backoff(self.backoff_s, self.backoff_cap_s).delay(attempt - 1)


def _reason(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        detail = resp.text
    return f"HTTP {resp.status_code}: {str(detail)[:300]}"


def replica_info(
    url: str, timeout_s: float = 5.0, token: str | None = None, client: httpx.Client | None = None
) -> dict[str, Any]:
    """``GET {url}/v1/policy_version``: ``{"policy_version": int, "dtype": str | None}``
    (raises on any failure). ``client``: as for ``weight_sync.post_weights``."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = (client or httpx).get(
        url.rstrip("/") + "/v1/policy_version", timeout=timeout_s, headers=headers
    )
    r.raise_for_status()
    body = r.json()
    return {"policy_version": int(body["policy_version"]), "dtype": body.get("dtype")}


def replica_version(
    url: str, timeout_s: float = 5.0, token: str | None = None, client: httpx.Client | None = None
) -> int:
    """``GET {url}/v1/policy_version`` (raises on any failure)."""
    return int(replica_info(url, timeout_s, token, client)["policy_version"])


def wire_dtype_of(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` -> torch.bfloat16 for the floating wire dtypes; None for anything else."""
    dt = ws.WIRE_DTYPES.get(name or "")
    return dt if dt is not None and dt.is_floating_point and dt != torch.float64 else None


def replica_versions(
    urls: Sequence[str], timeout_s: float = 5.0, token: str | None = None
) -> dict[str, int | None]:
    """Version of every replica (None where it could not be read), queried in parallel;
    ``token``: the bearer token (a replica with an api key requires one)."""
    if not urls:
        return {}
    with cf.ThreadPoolExecutor(min(16, len(urls))) as pool:
        futs = {u: pool.submit(replica_version, u, timeout_s, token) for u in urls}
        out: dict[str, int | None] = {}
        for u, f in futs.items():
            try:
                out[u] = f.result()
            except Exception as e:  # unreachable replica: unknown version
                log.warning("cannot read the policy version of %s: %s", u, e)
                out[u] = None
        return out


# ---------------------------------------------------------------------------- HTTP plane


@dataclass
class HttpPolicyPublisher:
    """Safetensors over ``POST /v1/weights?version=N`` to every replica in parallel.

    The state dict is serialised *once* and the same bytes are POSTed to every replica (the
    wire format of ``weight_sync.push_http``). A 409 (version not greater) is resolved by
    asking the replica's ``/v1/policy_version``: already at ``version`` (a retry of an update
    whose reply was lost) counts as acknowledged. 400/401/403/413/422 are configuration
    errors and are not retried.

    ``wire_dtype``: floating tensors are cast to it before sending; ``"auto"`` (default) asks
    the first replica which dtype it serves (``GET /v1/policy_version`` -> ``dtype``) and
    uses that, so an fp32 learner sends bf16 to a bf16 server (half the bytes; the server
    would cast anyway).

    LoRA: by default the Trainer's ``OptimizerStep.publish_state_dict()`` merges the adapters
    (W + B A * scale, base-layer names), so every publisher ships full merged weights. With
    ``TrainerConfig.lora_publish == "adapter"`` it holds the LoRA tensors alone, and a
    publisher given ``adapter`` (the peft config) POSTs them to ``/v1/adapter`` of replicas
    started with ``max_lora_rank`` (vLLM's LoRA support loads them as a new adapter per
    version).
    """

    replicas: ReplicaSet
    token: str | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    on_result: ResultFn | None = None
    acked: dict[str, int] = field(default_factory=dict)
    last_replicas: list[str] = field(default_factory=list)
    wire_dtype: str = "auto"  # "auto" (the replicas' served dtype), "none", or a float dtype
    # a LoRA adapter's peft config (r, lora_alpha, target_modules): publish() then gets the
    # adapter tensors and sends them to /v1/adapter; None: full weights to /v1/weights
    adapter: Mapping[str, Any] | None = None
    _auto_dtype: torch.dtype | None = field(default=None, init=False)
    last_bytes: int = field(default=0, init=False)  # the last publish's body size
    # one client for every publish (thread-safe: the replicas are pushed to in parallel)
    _http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=None), init=False)

    def __post_init__(self) -> None:
        if self.wire_dtype not in ("auto", "none") and wire_dtype_of(self.wire_dtype) is None:
            raise ValueError(
                f"wire_dtype={self.wire_dtype!r}: use auto, none, float32, bfloat16 or float16"
            )

    @property
    def _route(self) -> str:
        return ws.WEIGHTS_ROUTE if self.adapter is None else ws.ADAPTER_ROUTE

    def _dtype_for(self, urls: Sequence[str]) -> torch.dtype | None:
        """The dtype floating tensors are sent in (None: as trained)."""
        if self.wire_dtype == "none":
            return None
        if self.wire_dtype != "auto":
            return wire_dtype_of(self.wire_dtype)
        if self._auto_dtype is None:
            for u in urls:
                try:
                    self._auto_dtype = wire_dtype_of(
                        replica_info(u, 5.0, self.token, self._http)["dtype"]
                    )
                except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
                    log.warning("cannot read the served dtype of %s (%s); sending as trained", u, e)
                    continue
                break
        return self._auto_dtype

    def _push_one(self, url: str, body: bytes, version: int, deadline: float) -> tuple[bool, str]:
        """(acknowledged?, last reason) after at most max_attempts bounded attempts."""
        why = "not tried"
        for attempt in range(1, self.retry.max_attempts + 1):
            left = deadline - time.monotonic()
            if left <= 0.05:
                return False, f"{why} (publish deadline {self.retry.total_timeout_s:.0f}s reached)"
            t = min(self.retry.attempt_timeout_s, left)
            timeout = httpx.Timeout(t, connect=min(self.retry.connect_timeout_s, t))
            try:
                resp = ws.post_weights(
                    url, body, version, self.token, timeout, self._http, self._route
                )
                if resp.status_code == 200:
                    got = int(resp.json()["policy_version"])
                    if got == version:
                        return True, ""
                    why = f"replica answered 200 with policy_version={got}, expected {version}"
                elif resp.status_code == 409:
                    cur = replica_version(url, min(5.0, left), self.token, self._http)
                    if cur == version:
                        return True, ""
                    why = f"HTTP 409: replica serves version {cur}, learner publishes {version}"
                    if cur > version:
                        return False, why + " (replica is ahead; another learner publishing?)"
                elif resp.status_code in _PERMANENT:
                    return False, _reason(resp)
                else:
                    why = _reason(resp)
            except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if attempt < self.retry.max_attempts:
                log.warning(
                    "publish v%d to %s attempt %d/%d failed: %s; retrying",
                    version,
                    url,
                    attempt,
                    self.retry.max_attempts,
                    why,
                )
                time.sleep(min(self.retry.delay(attempt), max(0.0, deadline - time.monotonic())))
        return False, f"{why} (after {self.retry.max_attempts} attempts)"

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int | None) -> None:
        version, urls = _targets(self, version, "HttpPolicyPublisher")
        meta = ws.adapter_metadata(self.adapter) if self.adapter is not None else None
        body = ws.to_safetensors_bytes(state_dict, self._dtype_for(urls), meta)
        self.last_bytes = len(body)
        deadline = time.monotonic() + self.retry.total_timeout_s
        failures: dict[str, str] = {}
        ok: list[str] = []
        pool = cf.ThreadPoolExecutor(min(32, len(urls)))
        try:
            futs = {u: pool.submit(self._push_one, u, body, version, deadline) for u in urls}
            for u, f in futs.items():
                try:  # _push_one is bounded by the deadline; the margin covers its last reply
                    acked, why = f.result(timeout=max(0.1, deadline - time.monotonic()) + 5.0)
                except cf.TimeoutError:
                    acked, why = False, f"no answer within {self.retry.total_timeout_s:.0f}s"
                self._record(u, version if acked else None, None if acked else why)
                (ok.append(u) if acked else failures.__setitem__(u, why))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if failures:
            raise PublishError(version, failures, ok)

    def _record(self, url: str, version: int | None, why: str | None) -> None:
        if version is not None:
            self.acked[url] = version
        if self.on_result is not None:
            self.on_result(url, version, why)

    def close(self) -> None:
        self._http.close()


# ---------------------------------------------------------------------------- collective plane


class Rank0OnlyPublisher:
    """The spec's wrapper for multi-GPU training: every rank may call ``publish``; rank 0
    sends through ``inner``, every other rank returns at once (it holds no gathered
    weights). Sharing rank 0's outcome is the caller's (VersionedPublisher.finish).

    Under torch.distributed the Trainer gathers the state dict on every rank and every rank
    calls ``publish`` (in a background thread) through this wrapper: only rank 0, which
    alone holds the gathered weights, sends; the outcome reaches the other ranks from the
    Trainer's publishing (libludic/training/publishing.py: ``VersionedPublisher.finish``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int | None) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 0:
            self.inner.publish(state_dict, version)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@dataclass
class BroadcastPolicyPublisher:
    """HTTP control plane + one collective broadcast of the tensors to every replica.

    The group (``weight_sync.CollectiveWeightSender``) is (re)built when the replica set
    changes or after a failed round; a round is all-or-nothing (a replica that refuses
    aborts it for all), retried up to ``max_attempts`` times.

    ``master_address`` must be reachable from the replicas (the learner's pod IP / host
    name); ``master_port`` 0 picks a free port at every group (re)build.
    """

    replicas: ReplicaSet
    master_address: str
    master_port: int = 0
    token: str | None = None
    backend: str = "gloo"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    on_result: ResultFn | None = None
    acked: dict[str, int] = field(default_factory=dict)
    last_replicas: list[str] = field(default_factory=list)
    last_bytes: int = field(default=0, init=False)  # the last publish's tensor bytes
    _sender: Any = None
    _urls: list[str] = field(default_factory=list)

    def _close_sender(self) -> None:
        if self._sender is not None:
            try:
                self._sender.close()
            except Exception as e:  # a broken group must not block the rebuild
                log.warning("closing the weight-broadcast group failed: %s", e)
            self._sender = None

    def _ensure_sender(self, urls: list[str], timeout_s: float) -> Any:
        if self._sender is not None and urls == self._urls:
            return self._sender
        self._close_sender()
        port = self.master_port or _free_port()
        sender = ws.CollectiveWeightSender(
            urls=list(urls),
            master_address=self.master_address,
            master_port=port,
            token=self.token,
            backend=self.backend,
            timeout_s=timeout_s,
        )
        _bounded(sender.init, timeout_s + 5.0, "collective init")
        self._sender, self._urls = sender, list(urls)
        return sender

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int | None) -> None:
        version, urls = _targets(self, version, "BroadcastPolicyPublisher")
        deadline = time.monotonic() + self.retry.total_timeout_s
        why = "not tried"
        for attempt in range(1, self.retry.max_attempts + 1):
            left = deadline - time.monotonic()
            if left <= 0.05:
                break
            t = min(self.retry.attempt_timeout_s, left)
            try:
                sender = self._ensure_sender(urls, t)
                sender.timeout_s = t
                _bounded(
                    functools.partial(sender.send, state_dict, version), t + 5.0, "collective send"
                )
                self.last_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
                for u in urls:
                    self._record(u, version, None)
                return
            except Exception as e:  # any failure: rebuild the group, retry within the budget
                why = f"{type(e).__name__}: {e}"
                self._close_sender()
                if attempt < self.retry.max_attempts:
                    log.warning(
                        "collective publish v%d attempt %d/%d failed: %s; retrying",
                        version,
                        attempt,
                        self.retry.max_attempts,
                        why,
                    )
                    time.sleep(
                        min(self.retry.delay(attempt), max(0.0, deadline - time.monotonic()))
                    )
        for u in urls:
            self._record(u, None, why)
        raise PublishError(version, {u: why for u in urls})

    def _record(self, url: str, version: int | None, why: str | None) -> None:
        if version is not None:
            self.acked[url] = version
        if self.on_result is not None:
            self.on_result(url, version, why)

    def close(self) -> None:
        self._close_sender()


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run ``fn`` in a daemon thread; TimeoutError if it does not return in ``timeout_s``
    (the thread is abandoned: collective calls have no cancel, the group is rebuilt)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["v"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["e"] = e

    th = threading.Thread(target=run, name=f"ludic-{what}", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f}s")
    if "e" in box:
        raise box["e"]
    return box.get("v")
