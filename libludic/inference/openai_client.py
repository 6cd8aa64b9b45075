"""OpenAI-compatible HTTP ChatClient (vLLM / ``ludic inference``), async over httpx.

Asks for what the ReturnSpec says: ``return_token_ids`` (vLLM returns top-level
``prompt_token_ids`` and per-choice ``token_ids``) and ``logprobs`` (chosen-token
logprobs in ``choices[0].logprobs.content[i].logprob``). The policy version comes from
the body's ``policy_version`` or the ``X-Ludic-Policy-Version`` header.

Failures: connection errors, timeouts, 429 and 5xx are retried ``max_retries`` times
with exponential backoff (``backoff_s * 2**attempt``, capped at ``max_backoff_s``); other
4xx fail at once. Whatever still fails raises InferenceError naming the URL and cause.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import httpx

from libludic.inference.client import InferenceError
from libludic.inference.request import ChatCompletionRequest
from libludic.types import ChatResponse

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


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
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.auth_token = auth_token
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
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
                if resp.status_code not in RETRY_STATUS:
                    raise InferenceError(
                        f"{method} {self.base_url}{path} failed with HTTP {resp.status_code}: {resp.text[:300]}"
                    )
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if attempt < self.max_retries:
                await asyncio.sleep(min(self.max_backoff_s, self.backoff_s * 2**attempt))
        raise InferenceError(
            f"{method} {self.base_url}{path} failed after {self.max_retries + 1} attempts "
            f"(is the server up?): {last}"
        )

    async def _json(self, method: str, path: str, **kw: Any) -> tuple[dict[str, Any], httpx.Response]:
        resp = await self._request(method, path, **kw)
        try:
            data = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InferenceError(f"{method} {self.base_url}{path} answered malformed JSON: {e}: {resp.text[:200]!r}") from e
        if not isinstance(data, dict):
            raise InferenceError(f"{method} {self.base_url}{path} answered {type(data).__name__}, expected an object")
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
                    raise InferenceError(f"{self.base_url}/v1/models lists no model: {data!r:.200}") from e
        return self.model

    def _body(self, req: ChatCompletionRequest, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": list(req.messages), **req.sampling.to_openai()}
        if req.seed is not None:
            body["seed"] = req.seed
        rs = req.return_spec
        if rs.return_token_ids:
            body["return_token_ids"] = True
        if rs.return_chosen_logprobs:
            body["logprobs"] = True
            if rs.top_logprobs_k > 0:
                body["top_logprobs"] = rs.top_logprobs_k
        if req.tools:
            body["tools"] = req.tools
        return body

    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]:
        model = request.model or await self.default_model()
        data, resp = await self._json("POST", "/v1/chat/completions", json=self._body(request, model))
        return parse_chat_completion(data, resp.headers, request, self.base_url), {"raw": data, "url": self.base_url}

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

    def sync_weights(self, params: Mapping[str, Any], timeout_s: float = 600.0, version: int | None = None) -> str:
        """Push a state dict over the HTTP weight plane (POST /v1/weights)."""
        from libludic.distributed.weight_sync import push_http

        if version is None:
            raise ValueError("sync_weights over HTTP needs an explicit version")
        acked = push_http(self.base_url, params, version, self.auth_token, timeout_s)
        return f"policy_version={acked}"


def parse_chat_completion(
    data: Mapping[str, Any], headers: Mapping[str, str], request: ChatCompletionRequest, url: str = ""
) -> ChatResponse:
    try:
        choice = data["choices"][0]
        message = choice.get("message") or {}
        text = message.get("content") or ""
        finish = choice.get("finish_reason") or "stop"
    except (KeyError, IndexError, TypeError) as e:
        raise InferenceError(f"{url}: chat completion has no choices[0].message: {dict(data)!r:.300}") from e
    rs = request.return_spec
    prompt_ids = data.get("prompt_token_ids", choice.get("prompt_token_ids"))
    comp_ids = choice.get("token_ids", choice.get("completion_token_ids"))
    if rs.return_token_ids and (prompt_ids is None or comp_ids is None):
        raise InferenceError(
            f"{url} did not return token ids although return_token_ids was asked; "
            "use `ludic inference` or a vLLM that supports return_token_ids"
        )
    logprobs: list[float] | None = None
    if rs.return_chosen_logprobs:
        content = (choice.get("logprobs") or {}).get("content")
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
