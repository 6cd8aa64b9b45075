"""HTTPVerifier: a remote service scores each rollout (the ``http_verifier`` reward kind).

``POST url`` with the JSON body ``{"prompt", "completion", "answer", "env_reward", "info",
"task", "env_seed", "agent_id"}`` (``info``: the last step's info, values that JSON cannot
hold written as strings); the reply is ``{"reward": <number>}``. Connection errors,
timeouts, 429 and 5xx are retried ``retries`` times after the project's backoff
(:class:`libludic.retry.Backoff`); another status, a body without a finite ``reward``, or a
failure after the retries raises RewardError (the request is dead-lettered with the reason).
A bearer token, when the service wants one, is read from the environment variable
``api_key_env``, never from the config.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from typing import Any

import httpx

from libludic.retry import Backoff
from libludic.scoring.base import RewardError, RewardInput

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class HTTPVerifier:
    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        api_key_env: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"http_verifier url={url!r} must be an http(s) URL")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError("http_verifier needs timeout_s > 0, retries >= 0, backoff_s >= 0")
        headers = {}
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"http_verifier api_key_env={api_key_env!r} is not set")
            headers["Authorization"] = f"Bearer {key}"
        self.url, self.retries = url, retries
        self.backoff = Backoff(backoff_s, max(backoff_s, 8.0))
        self.timeout = httpx.Timeout(timeout_s)
        self.headers = headers
        self._http: httpx.AsyncClient | None = None

    def body(self, sample: RewardInput) -> dict[str, Any]:
        meta = sample.rollout.meta
        info = json.loads(json.dumps(dict(sample.info), default=str))
        return {
            "prompt": sample.prompt,
            "completion": sample.completion,
            "answer": sample.answer,
            "env_reward": sample.env_reward,
            "info": info,
            "task": sample.task,
            "env_seed": meta.get("env_seed"),
            "agent_id": sample.agent_id,
        }

    async def __call__(self, sample: RewardInput) -> float:
        if self._http is None:  # made in the event loop that uses it
            self._http = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)
        body, last = self.body(sample), ""
        for attempt in range(self.retries + 1):
            try:
                resp = await self._http.post(self.url, json=body)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code == 200:
                    return self._reward(resp)
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code not in RETRY_STATUS:
                    raise RewardError(f"http_verifier {self.url}: {last}")
            if attempt < self.retries:
                await asyncio.sleep(self.backoff.delay(attempt))
        raise RewardError(
            f"http_verifier {self.url}: failed after {self.retries + 1} attempts: {last}"
        )

    def _reward(self, resp: httpx.Response) -> float:
        try:
            r = resp.json()["reward"]
        except (ValueError, KeyError, TypeError):
            raise RewardError(
                f'http_verifier {self.url}: reply {resp.text[:200]!r} is not {{"reward": <number>}}'
            ) from None
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
            raise RewardError(f"http_verifier {self.url}: reward {r!r} is not a finite number")
        return float(r)

    def __repr__(self) -> str:
        return f"HTTPVerifier({self.url!r})"
