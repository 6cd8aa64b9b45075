"""OpenAI-compatible HTTP ChatClient (vLLM / ``ludic inference``), async over httpx.

Asks for what the ReturnSpec says: ``return_token_ids`` (vLLM returns top-level
``prompt_token_ids`` and per-choice ``token_ids``) and ``logprobs`` (chosen-token
logprobs in ``choices[0].logprobs.content[i].logprob``). The policy version comes from
the body's ``policy_version`` or the ``X-Ludic-Policy-Version`` header.

Failures: connection errors, timeouts, 429 and 5xx are retried ``max_retries`` times
with exponential backoff (:class:`libludic.retry.Backoff`: ``backoff_s`` doubling, capped at ``max_backoff_s``); other
4xx fail at once. Whatever still fails raises InferenceError naming the URL and cause; a 400
saying the prompt fills the model's context raises ContextLengthExceeded (the episode ends).

Coalescing (``coalesce=True``, the default). Calls of ``complete()`` made in the same
event-loop iteration that differ only in their seed (same model, messages, sampling, return
spec and tools: a GRPO group's first turn) are sent as one request with ``n`` choices. The
seeds of one such request must be consecutive, ``s, s+1, ..., s+n-1``, and it is sent with
``seed=s``: vLLM gives choice ``i`` of a seeded ``n``-request the seed ``s + i``, so every
caller gets exactly the sample its own request would have drawn; unseeded calls coalesce
among themselves; greedy calls (temperature 0) are never coalesced (vLLM refuses n > 1
for them). At most ``max_coalesce`` calls share a request. The server does its
per-request work (chat template, tokenisation, response building) once instead of ``n``
times: on a 2-core machine, 64 samples of 8 tokens cost 5.3 CPU-ms each through the
server one request per sample and 2.8 CPU-ms coalesced by 8. The response's
``policy_version`` is that of the whole request (the oldest version that produced any of
its tokens).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from libludic.inference.client import ContextLengthExceeded, InferenceError
from libludic.inference.request import ChatCompletionRequest
from libludic.retry import Backoff
from libludic.types import ChatResponse

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
# vLLM's 400 for a prompt with no room left for a completion (its two wordings: the prompt
# alone exceeds max_model_len, or it fills it and max_tokens comes out 0)
_CONTEXT_FULL = re.compile(
    r"maximum context length|max_tokens must be at least 1|parameter=input_tokens"
)


@dataclass
class _Waiting:
    """One ``complete()`` call waiting for its coalesced request."""

    request: ChatCompletionRequest
    future: asyncio.Future[tuple[ChatResponse, dict[str, Any]]]


@dataclass
class _Batch:
    """Calls that differ only in their seed, keyed by everything else."""

    calls: list[_Waiting] = field(default_factory=list)


def seed_runs(calls: list[_Waiting], limit: int) -> list[list[_Waiting]]:
    """Split calls into requests: runs of consecutive seeds (or unseeded calls), each of at
    most ``limit``. A seeded request with ``n`` choices uses seeds ``s .. s+n-1``."""
    seeded = sorted((c for c in calls if c.request.seed is not None), key=lambda c: c.request.seed)  # type: ignore[arg-type,return-value]
    unseeded = [c for c in calls if c.request.seed is None]
    runs: list[list[_Waiting]] = []
    for c in seeded:
        last = runs[-1] if runs else None
        if (
            last is not None and len(last) < limit and c.request.seed == last[-1].request.seed + 1  # type: ignore[operator]
        ):
            last.append(c)
        else:
            runs.append([c])
    runs += [unseeded[i : i + limit] for i in range(0, len(unseeded), limit)]
    return runs


class OpenAIChatClient:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        auth_token: str | None = None,
        model: str | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        transport: httpx.AsyncBaseTransport | None = None,
        coalesce: bool = True,
        max_coalesce: int = 64,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        if max_coalesce < 1:
            raise ValueError(f"max_coalesce={max_coalesce} must be >= 1")
        self.coalesce = coalesce
        self.max_coalesce = max_coalesce
        self._pending: dict[str, _Batch] = {}
        self._flush_scheduled = False
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.auth_token = auth_token
        self.max_retries = max_retries
        self.backoff = Backoff(backoff_s, max_backoff_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._model_lock: asyncio.Lock | None = None
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers=headers,
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        last: str = ""
        for attempt in range(self.max_retries + 1):
            try:
                resp = await self._http.request(method, path, **kw)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code == 400 and _CONTEXT_FULL.search(resp.text):
                    raise ContextLengthExceeded(
                        f"{method} {self.base_url}{path}: the prompt fills the model's "
                        f"context: {resp.text[:300]}"
                    )
                if resp.status_code not in RETRY_STATUS:
                    raise InferenceError(
                        f"{method} {self.base_url}{path} failed with HTTP {resp.status_code}: {resp.text[:300]}"
                    )
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff.delay(attempt))
        raise InferenceError(
            f"{method} {self.base_url}{path} failed after {self.max_retries + 1} attempts "
            f"(is the server up?): {last}"
        )

    async def _json(
        self, method: str, path: str, **kw: Any
    ) -> tuple[dict[str, Any], httpx.Response]:
        resp = await self._request(method, path, **kw)
        try:
            data = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InferenceError(
                f"{method} {self.base_url}{path} answered malformed JSON: {e}: {resp.text[:200]!r}"
            ) from e
        if not isinstance(data, dict):
            raise InferenceError(
                f"{method} {self.base_url}{path} answered {type(data).__name__}, expected an object"
            )
        return data, resp

    async def default_model(self) -> str:
        """The first model the server lists, fetched once (concurrent callers share it)."""
        if self.model is not None:
            return self.model
        if self._model_lock is None:
            self._model_lock = asyncio.Lock()
        async with self._model_lock:
            if self.model is None:
                data, _ = await self._json("GET", "/v1/models")
                try:
                    self.model = str(data["data"][0]["id"])
                except (KeyError, IndexError, TypeError) as e:
                    raise InferenceError(
                        f"{self.base_url}/v1/models lists no model: {data!r:.200}"
                    ) from e
        return self.model

    def _body(self, req: ChatCompletionRequest, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": list(req.messages),
            **req.sampling.to_openai(),
        }
        if req.seed is not None:
            body["seed"] = req.seed
        rs = req.return_spec
        if rs.return_token_ids:
            # token ids are what we read; logprob entries naming tokens by id spare the
            # server a decode per token (`ludic inference` then decodes the text once)
            body["return_token_ids"] = True
            body["return_tokens_as_token_ids"] = True
        if rs.return_chosen_logprobs:
            body["logprobs"] = True
            if rs.top_logprobs_k > 0:
                body["top_logprobs"] = rs.top_logprobs_k
        if req.tools:
            body["tools"] = req.tools
        return body

    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]:
        model = request.model or await self.default_model()
        if not self.coalesce or request.sampling.temperature == 0:
            # greedy: vLLM refuses n > 1, and identical greedy calls would answer alike anyway
            return (await self._send([request], model))[0]
        body = self._body(request, model)
        body.pop("seed", None)
        key = json.dumps(body, sort_keys=True, default=str)
        fut: asyncio.Future[tuple[ChatResponse, dict[str, Any]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending.setdefault(key, _Batch()).calls.append(_Waiting(request, fut))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # after every task already runnable in this iteration had its turn to join
            asyncio.get_running_loop().call_soon(self._flush, model)
        return await fut

    def _flush(self, model: str) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for batch in pending.values():
            for run in seed_runs(batch.calls, self.max_coalesce):
                asyncio.ensure_future(self._answer(run, model))

    async def _answer(self, run: list[_Waiting], model: str) -> None:
        try:
            results = await self._send([c.request for c in run], model)
        except BaseException as e:  # every caller of the shared request hears of it
            for c in run:
                if not c.future.done():
                    c.future.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        for c, res in zip(run, results):
            if not c.future.done():
                c.future.set_result(res)

    async def _send(
        self, requests: list[ChatCompletionRequest], model: str
    ) -> list[tuple[ChatResponse, dict[str, Any]]]:
        """One POST for ``requests`` (identical but for consecutive seeds): ``n`` choices,
        one result per request in order."""
        first = requests[0]
        body = self._body(first, requests[0].model or model)
        if len(requests) > 1:
            body["n"] = len(requests)
        data, resp = await self._json("POST", "/v1/chat/completions", json=body)
        meta = {"raw": data, "url": self.base_url}
        out = [
            (parse_chat_completion(data, resp.headers, r, self.base_url, choice=i), meta)
            for i, r in enumerate(requests)
        ]
        return out

    async def get_policy_version(self) -> int:
        data, _ = await self._json("GET", "/v1/policy_version")
        try:
            return int(data["policy_version"])
        except (KeyError, TypeError, ValueError) as e:
            raise InferenceError(f"{self.base_url}/v1/policy_version answered {data!r:.200}") from e

    async def health(self) -> bool:
        try:
            resp = await self._http.get("/health")
        except httpx.TransportError:
            return False
        return resp.status_code == 200

    def sync_weights(
        self, params: Mapping[str, Any], timeout_s: float = 600.0, version: int | None = None
    ) -> str:
        """Push a state dict over the HTTP weight plane (POST /v1/weights)."""
        # weight_sync imports torch, which only this push needs, not the actors' HTTP client
        from libludic.distributed.weight_sync import push_http

        if version is None:
            raise ValueError("sync_weights over HTTP needs an explicit version")
        acked = push_http(self.base_url, params, version, self.auth_token, timeout_s)
        return f"policy_version={acked}"


def parse_chat_completion(
    data: Mapping[str, Any],
    headers: Mapping[str, str],
    request: ChatCompletionRequest,
    url: str = "",
    choice: int = 0,
) -> ChatResponse:
    """Choice ``choice`` of a chat completion body (by its ``index``) as a ChatResponse."""
    try:
        choices = data["choices"]
        picked = [c for c in choices if c.get("index", 0) == choice]
        choice_d = picked[0] if picked else choices[choice]
        message = choice_d.get("message") or {}
        text = message.get("content") or ""
        finish = choice_d.get("finish_reason") or "stop"
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise InferenceError(
            f"{url}: chat completion has no choices[{choice}].message: {dict(data)!r:.300}"
        ) from e
    ch: Mapping[str, Any] = choice_d
    rs = request.return_spec
    prompt_ids = data.get("prompt_token_ids", ch.get("prompt_token_ids"))
    comp_ids = ch.get("token_ids", ch.get("completion_token_ids"))
    if rs.return_token_ids and (prompt_ids is None or comp_ids is None):
        raise InferenceError(
            f"{url} did not return token ids although return_token_ids was asked; "
            "use `ludic inference` or a vLLM that supports return_token_ids"
        )
    logprobs: list[float] | None = None
    if rs.return_chosen_logprobs:
        content = (ch.get("logprobs") or {}).get("content")
        if content is None:
            raise InferenceError(f"{url} returned no logprobs.content although logprobs were asked")
        logprobs = [float(c["logprob"]) for c in content]
        if comp_ids is not None and len(logprobs) != len(comp_ids):
            raise InferenceError(
                f"{url} returned {len(logprobs)} logprobs for {len(comp_ids)} completion tokens"
            )
    pv = data.get("policy_version")
    if pv is None and "x-ludic-policy-version" in {k.lower() for k in headers}:
        pv = {k.lower(): v for k, v in headers.items()}["x-ludic-policy-version"]
    return ChatResponse(
        text=text,
        finish_reason=str(finish),
        prompt_token_ids=None if prompt_ids is None else [int(t) for t in prompt_ids],
        completion_token_ids=None if comp_ids is None else [int(t) for t in comp_ids],
        completion_logprobs=logprobs,
        policy_version=None if pv is None else int(pv),
        tool_calls=message.get("tool_calls"),
        temperature=float(request.sampling.temperature),
    )
