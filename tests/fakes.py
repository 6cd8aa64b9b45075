"""The fakes of the tests, in one module: a scripted ChatClient with byte-level token ids;
an OpenAI-compatible replica over HTTP (``FakeOpenAIServer``: the generation side of
``ludic inference``); hand-built rollouts, SAW items, a list batch source and a rollout
engine; and the weight side of an inference replica, the real app
(services/inference/app.py) around an engine that holds tensors instead of vLLM
(``TensorEngine``, served over HTTP by ``ServedApp``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from libludic.inference.request import ChatCompletionRequest
from libludic.saw import SampleAttachments, SAWBatch, SAWItem
from libludic.types import ChatResponse, Rollout, Step, TokenTrace

Reply = str | Callable[[ChatCompletionRequest], str]
T = TypeVar("T")


async def ticks_during(work: Awaitable[T], period_s: float) -> tuple[T, int]:
    """``work``'s result, and how often a task on the same event loop woke every
    ``period_s`` meanwhile: ~duration / period when ``work`` leaves the loop free, 0 when
    it holds it."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(period_s)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        return await work, ticks
    finally:
        ticker.cancel()


class ScriptedClient:
    """Answers with the next scripted reply (or a function of the request); the last reply
    repeats.

    Token ids are UTF-8 bytes of the prompt/reply (like the tiny model's tokenizer) and EOS
    (258); logprobs are -0.5 per token; ``policy_version`` is settable. ``fail_first``: the
    first k calls raise InferenceError (a replica restarting); ``context``: a prompt longer
    than this many bytes raises ContextLengthExceeded (a server's max_model_len).
    """

    def __init__(
        self,
        replies: Sequence[Reply],
        policy_version: int = 0,
        fail_first: int = 0,
        context: int | None = None,
    ):
        self.context = context  # prompt bytes past which a call raises ContextLengthExceeded
        self.replies = list(replies)
        self.requests: list[ChatCompletionRequest] = []
        self.policy_version = policy_version
        self.fail_first = fail_first
        self.calls = 0

    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]:
        from libludic.inference.client import InferenceError

        self.calls += 1
        if self.calls <= self.fail_first:
            raise InferenceError("replica restarting")
        self.requests.append(request)
        if not self.replies:
            raise AssertionError("ScriptedClient ran out of replies")
        prompt = "".join(f"<{m['role']}>{m['content']}" for m in request.messages)
        if self.context is not None and len(prompt.encode()) > self.context:
            from libludic.inference.client import ContextLengthExceeded

            raise ContextLengthExceeded(f"{len(prompt.encode())} prompt tokens > {self.context}")
        r = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        text = r(request) if callable(r) else r
        ids = list(text.encode()) + [258]
        return (
            ChatResponse(
                text=text,
                finish_reason="stop",
                prompt_token_ids=list(prompt.encode()),
                completion_token_ids=ids,
                completion_logprobs=[-0.5] * len(ids),
                policy_version=self.policy_version,
            ),
            {},
        )

    async def get_policy_version(self) -> int:
        return self.policy_version

    def sync_weights(
        self, params: Mapping[str, Any], timeout_s: float = 600.0, version: int | None = None
    ) -> str:
        self.policy_version = self.policy_version + 1 if version is None else version
        return "ok"


@dataclass(frozen=True)
class Choice:
    """What a FakeOpenAIServer answers: the text, its token ids and chosen-token logprobs."""

    text: str = "42"
    token_ids: tuple[int, ...] = (52, 50, 258)  # "4", "2", EOS of the tiny model
    logprobs: tuple[float, ...] = (-0.1, -0.2, -0.3)
    finish_reason: str = "stop"


class FakeOpenAIServer:
    """An OpenAI-compatible replica answering like ``ludic inference`` (token ids, chosen-token
    logprobs, ``policy_version`` in the body and the ``X-Ludic-Policy-Version`` header) on a
    free loopback port, served from a thread; no model behind it.

    ``POST /v1/chat/completions`` answers ``reply`` after ``delay_s``, with the prompt's ids
    ``[257] + UTF-8 bytes of the last message`` (im_start, then the tiny model's byte ids); a
    request with ``n > 1`` gets ``n`` choices, choice ``i`` the one token ``100 + seed + i``
    (vLLM seeds choice i with seed + i) with logprob ``-0.5 - i``, listed in reverse (the
    order on the wire must not matter). ``fail_next``: status codes answered first
    (``{"error": "boom"}``); ``mode`` ``"malformed"`` (not JSON) or ``"no_ids"`` (no token
    ids). ``GET /v1/models`` (``model``), ``/v1/policy_version`` (``endpoint_version``,
    default ``version``), ``/health`` when ``health``. Records ``bodies``, ``calls`` and
    ``model_gets``; ``close()`` stops it (a replica gone).
    """

    def __init__(
        self,
        reply: Choice = Choice(),
        version: int = 0,
        endpoint_version: int | None = None,
        delay_s: float = 0.0,
        model: str = "tiny",
        health: bool = True,
    ) -> None:
        import json
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.reply, self.version, self.endpoint_version = reply, version, endpoint_version
        self.delay_s, self.model, self.health = delay_s, model, health
        self.bodies: list[dict[str, Any]] = []
        self.fail_next: list[int] = []
        self.mode = "ok"
        self.calls = self.model_gets = 0
        lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, obj: Any, code: int = 200, raw: bytes | None = None) -> None:
                body = raw if raw is not None else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if code == 200:
                    self.send_header("X-Ludic-Policy-Version", str(fake.version))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    with lock:
                        fake.model_gets += 1
                    self._send({"data": [{"id": fake.model}]})
                elif self.path == "/v1/policy_version":
                    v = fake.version if fake.endpoint_version is None else fake.endpoint_version
                    self._send({"policy_version": v})
                elif self.path == "/health" and fake.health:
                    self._send({"ok": True})
                else:
                    self._send({"error": "not found"}, 404)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with lock:
                    fake.bodies.append(body)
                    fake.calls += 1
                    fail = fake.fail_next.pop(0) if fake.fail_next else None
                if fail is not None:
                    return self._send({"error": "boom"}, fail)
                time.sleep(fake.delay_s)
                self._send(
                    fake.answer(body), raw=b"{not json" if fake.mode == "malformed" else None
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.reply
        if self.mode == "no_ids":
            return {"choices": [{"message": {"content": r.text}, "finish_reason": r.finish_reason}]}
        n = int(body.get("n", 1))
        if n > 1:
            base = 100 + int(body.get("seed", 0))
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": chr(base + i)},
                    "finish_reason": "stop",
                    "token_ids": [base + i],
                    "logprobs": {"content": [{"logprob": -0.5 - i}]},
                }
                for i in reversed(range(n))
            ]
        else:
            choices = [
                {
                    "message": {"role": "assistant", "content": r.text},
                    "finish_reason": r.finish_reason,
                    "token_ids": list(r.token_ids),
                    "logprobs": {"content": [{"logprob": lp} for lp in r.logprobs]},
                }
            ]
        prompt = str(body["messages"][-1]["content"]).encode()
        return {
            "choices": choices,
            "prompt_token_ids": [257, *prompt],
            "policy_version": self.version,
        }

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeOpenAIServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_step(
    index: int = 0,
    reward: float = 0.0,
    prompt: Sequence[int] = (1, 2, 3),
    completion: Sequence[int] = (4, 5),
    logprobs: Sequence[float] | None = None,
    policy_version: int | None = 0,
    info: dict[str, Any] | None = None,
    truncated: bool = False,
    trace: bool = True,
) -> Step:
    return Step(
        index=index,
        prev_obs="q",
        action="a",
        next_obs=None,
        reward=reward,
        truncated=truncated,
        terminated=not truncated,
        info=dict(info or {}),
        trace=TokenTrace(
            list(prompt), list(completion), None if logprobs is None else list(logprobs)
        )
        if trace
        else None,
        policy_version=policy_version,
    )


def make_rollout(
    rid: str, rewards: Sequence[float], group_id: str | None = None, **kw: Any
) -> Rollout:
    meta = {} if group_id is None else {"group_id": group_id}
    return Rollout(id=rid, steps=[make_step(i, r, **kw) for i, r in enumerate(rewards)], meta=meta)


def make_item(
    n_state: int,
    n_action: int,
    weight: float = 1.0,
    seed: int = 0,
    policy_version: int | None = 0,
    vocab: int = 250,
    logprobs: bool = True,
) -> SAWItem:
    ids = [(seed * 31 + 7 * i + 3) % vocab for i in range(n_state + n_action)]
    lp = [0.0] * n_state + [-1.0 - 0.01 * ((seed + i) % 7) for i in range(n_action)]
    return SAWItem(
        input_ids=ids,
        attention_mask=[1] * len(ids),
        action_mask=[0] * n_state + [1] * n_action,
        weight=weight,
        meta={"item_id": f"it{seed}", "reward": weight},
        attachments=SampleAttachments(
            actor_logprobs=lp if logprobs else None, policy_version=policy_version
        ),
    )


class ListBatchSource:
    """Hands out the given batches in order, cycling; has a resumable position."""

    def __init__(self, batches: Sequence[Sequence[SAWItem]]) -> None:
        self.batches = [list(b) for b in batches]
        self.pos = 0

    async def next_batch(self) -> SAWBatch:
        b = self.batches[self.pos % len(self.batches)]
        self.pos += 1
        return SAWBatch(items=list(b))

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, s: dict[str, int]) -> None:
        self.pos = int(s["pos"])


class FakeEngine:
    """generate_rollouts: request i's episodes get reward ``rewards[call][i]`` (one step each)."""

    def __init__(self, rewards_per_call: list[list[float]]) -> None:
        self.rewards_per_call = rewards_per_call
        self.calls: list[dict[str, Any]] = []

    async def generate_rollouts(
        self, requests, max_steps: int, concurrency: int = 8
    ) -> list[Rollout]:
        rewards = self.rewards_per_call[len(self.calls) % len(self.rewards_per_call)]
        self.calls.append(
            {"requests": list(requests), "max_steps": max_steps, "concurrency": concurrency}
        )
        out = []
        k = 0
        for req in requests:
            for e in range(req.num_episodes):
                out.append(
                    make_rollout(
                        f"{req.id}-{e}",
                        [rewards[k % len(rewards)]],
                        group_id=req.meta.get("group_id"),
                        logprobs=[-0.5, -0.7],
                    )
                )
                k += 1
        return out


class ServedModel:
    """What the ``ludic`` weight-transfer engine (services/inference/weight_transfer.py)
    loads into, in place of a vLLM model: ``load_weights`` copies HF-named tensors into
    ``served``; one plain CPU linear layer (vllm_plugin.plain_linear) makes an update a copy
    (``worker_ext.copy_reload_applies``)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        import torch

        from services.inference.vllm_plugin import plain_linear

        self.served = {k: v.clone() for k, v in tensors.items()}
        self.layer = torch.nn.Module()
        self.layer.cpu_linear = plain_linear  # type: ignore[assignment]
        self.loads = 0

    def modules(self) -> list[Any]:
        return [self.layer]

    def load_weights(self, weights: Any) -> None:
        for name, t in weights:
            self.served[name].copy_(t)
        self.loads += 1


def worker_vllm_config(rank: int, workers: int) -> Any:
    """The parts of vLLM's ``VllmConfig`` the ``ludic`` weight-transfer engine reads, for
    worker ``rank`` of ``workers`` (tensor parallel), serving float32."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=workers, rank=rank),
        model_config=SimpleNamespace(dtype=torch.float32, quantization=None),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


def transfer_worker(tensors: dict[str, Any], rank: int, workers: int) -> Any:
    """A ``LudicTransferEngine`` as vLLM builds it in worker ``rank`` of ``workers``, over a
    ``ServedModel`` of ``tensors``, on the CPU."""
    import torch
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from services.inference.vllm_plugin import TRANSFER_BACKEND, register_transfer_engine

    register_transfer_engine()
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=TRANSFER_BACKEND),
        worker_vllm_config(rank, workers),
        torch.device("cpu"),
        ServedModel(tensors),
    )


class TensorEngine:
    """The weight-route surface of LudicEngine (services/inference/worker.py) over tensors
    held in memory, no vLLM: ``create_app(settings, engine=...)`` answers the weight routes
    as the service does (auth, body cap, validation against ``spec``, 409 for an old
    version), and ``swap`` copies an update into ``served``. ``fail_first``: the first k
    swaps fail as a drain that timed out (503); ``hang``: swaps never finish until
    ``release()`` (a blackholed replica). The collective plane runs the real ``ludic``
    weight-transfer engine in ``workers`` (``transfer_workers`` of them, as many vLLM workers
    as a tensor-parallel replica has), called in this process where vLLM would make RPCs."""

    def __init__(
        self,
        spec: Any,
        tensors: dict[str, Any],
        fail_first: int = 0,
        hang: bool = False,
        transfer_workers: int = 1,
    ):
        from services.inference.metrics import InferenceMetrics

        self.spec = spec
        self.served = tensors
        self.version = 0
        self.updates: list[int] = []  # every version applied, in order
        self.adapters: list[tuple[int, dict[str, Any]]] = []  # (version, config) per adapter
        self.last: dict[str, Any] = {}  # the tensors of the last update, as sent
        self.fail_first = fail_first
        self.hang = hang
        self.released = False
        self.lock = asyncio.Lock()
        self.metrics = InferenceMetrics()
        self.serving = None
        self.transfer_workers = transfer_workers
        self.transfer_backends = ("gloo",)
        self.workers: list[Any] = []  # built at the first init (importing vLLM takes seconds)

    async def transfer_init(self, info: dict[str, Any]) -> None:
        if not self.workers:
            n = self.transfer_workers
            self.workers = [transfer_worker(self.served, i, n) for i in range(n)]
        for w in self.workers:
            w.init_transfer_engine(w.parse_init_info(info))

    async def transfer_receive(self, rnd: int, meta: dict[str, Any]) -> None:
        for w in self.workers:
            w.update_weights({"phase": "recv", "round": rnd, **meta})

    async def transfer_discard(self, rnd: int) -> None:
        for w in self.workers:
            w.update_weights({"phase": "discard", "round": rnd})

    async def transfer_swap(
        self, version: int, rnd: int, reload_seconds: Callable[[], Awaitable[float]]
    ) -> float:
        for w in self.workers:
            w.update_weights({"phase": "apply", "round": rnd})
        await reload_seconds()
        self.version = version
        self.updates.append(version)
        return 0.0

    @classmethod
    def of_model(cls, model_dir: Any, **kw: Any) -> TensorEngine:
        """Serving ``model_dir``'s weights (its safetensors), as the service would."""
        from pathlib import Path

        from safetensors.torch import load_file

        from services.inference.validation import ParamSpec

        tensors: dict[str, Any] = {}
        for shard in sorted(Path(model_dir).glob("*.safetensors")):
            tensors.update(load_file(str(shard)))
        return cls(ParamSpec.from_model_dir(model_dir), tensors, **kw)

    async def swap(self, version: int, tensors: dict[str, Any], payload: Any | None) -> float:
        from services.inference.worker import SwapError

        assert self.lock.locked()
        while self.hang and not self.released:
            await asyncio.sleep(0.05)
        if self.fail_first > 0:
            self.fail_first -= 1
            raise SwapError("drain timed out", status=503)
        for name, t in tensors.items():
            self.served[self.spec.aliases.get(name, name)].copy_(t)
        self.last = {k: v.clone() for k, v in tensors.items()}
        self.version = version
        self.updates.append(version)
        return 0.0

    async def swap_adapter(self, version: int, payload: Any, config: dict[str, Any]) -> float:
        """A validated LoRA adapter (``POST /v1/adapter``): recorded in ``adapters``."""
        assert self.lock.locked()
        self.adapters.append((version, dict(config)))
        self.version = version
        self.updates.append(version)
        return 0.0

    async def probe(self) -> tuple[bool, str]:
        return True, ""

    def release(self) -> None:
        self.released = True


class ServedApp:
    """``create_app(settings, engine)`` served by uvicorn on a free loopback port, in a
    thread; ``peers`` holds the client (host, port) of every request. Without a token the
    weight routes are open (``insecure_no_auth``)."""

    def __init__(self, engine: TensorEngine, model_dir: Any, token: str | None = None) -> None:
        import socket

        from services.inference.app import create_app
        from services.inference.settings import InferenceSettings

        self.engine = engine
        self.peers: set[tuple[str, int]] = set()
        settings = InferenceSettings(
            model_dir=str(model_dir), auth_token=token or "", insecure_no_auth=token is None
        )
        app = create_app(settings, engine=engine)

        @app.middleware("http")
        async def record_peer(request: Any, call_next: Any) -> Any:
            if request.client is not None:
                self.peers.add((request.client.host, request.client.port))
            return await call_next(request)

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.app = app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self) -> ServedApp:
        import threading
        import time

        import uvicorn

        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.release()
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
