"""OpenEnvEnv: an environment served by an OpenEnv server (Meta's openenv-core) as a LudicEnv.

OpenEnv serves an environment over HTTP and WebSocket (``create_app``). Its HTTP
``POST /reset`` and ``POST /step`` build a fresh environment for every request, so an
episode lives in a WebSocket session: one connection to ``<url>/ws`` is one environment
instance, driven by JSON text messages

    -> {"type": "reset", "data": {"seed": 3, ...reset_args}}
    -> {"type": "step", "data": {<the action's fields>}}
    -> {"type": "close"}
    <- {"type": "observation", "data": {"observation": {...}, "reward": r | null, "done": b}}
    <- {"type": "error", "data": {"message": ..., "code": "VALIDATION_ERROR" | ...}}

and ``GET <url>/schema`` gives the JSON schemas of the action and the observation. This
adapter speaks that protocol itself (``websockets``, ``httpx``): the project's venv needs
no openenv-core, only the server does.

Text in: the action is ``{action_field: text}``; without ``action_field``, the action
schema's one required field (besides ``metadata``); with ``json_action`` (or no such
field), the text parsed as a JSON object of the action's fields. Text out: the observation's ``observation_field``; without it, its
one string field, else the observation as JSON. The step's reward is the server's
(``null``: 0) and ``done`` terminates. An action that is not JSON or that the server
rejects (``VALIDATION_ERROR``) does not step the env: reward 0, the reason as the next
observation, ``info["invalid_action"]=True``. Any other server error raises.

``reset`` and ``step`` block on the socket (one round trip); ``astep`` runs ``step`` in a
worker thread so the caller's event loop keeps running.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping
from typing import Any

import httpx

try:
    from websockets.exceptions import WebSocketException
    from websockets.sync.client import ClientConnection, connect
except ImportError as e:
    raise ImportError(
        f"the openenv env kind needs the websockets package ({e}); pip install libludic[openenv]",
        name="websockets",
    ) from e

from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.types import Info, Obs, StepOutcome

_schemas_lock = threading.Lock()
_schemas: dict[str, dict[str, Any]] = {}


def ws_url(url: str) -> str:
    """``<url>/ws`` with the scheme OpenEnv's client uses (http -> ws, https -> wss)."""
    base = url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if base.startswith(http):
            return ws + base[len(http) :] + "/ws"
    if base.startswith(("ws://", "wss://")):
        return base + "/ws"
    return "ws://" + base + "/ws"


def http_url(url: str) -> str:
    base = url.rstrip("/")
    for ws, http in (("ws://", "http://"), ("wss://", "https://")):
        if base.startswith(ws):
            return http + base[len(ws) :]
    return base if base.startswith(("http://", "https://")) else "http://" + base


def fetch_schema(url: str, timeout_s: float) -> dict[str, Any]:
    """The server's ``GET /schema`` (action, observation, state), once per process."""
    with _schemas_lock:
        if url not in _schemas:
            try:
                r = httpx.get(http_url(url) + "/schema", timeout=timeout_s)
                r.raise_for_status()
            except httpx.HTTPError as e:
                raise ConnectionError(
                    f"OpenEnv server {url}: GET /schema failed ({e}); is the server running?"
                ) from e
            _schemas[url] = r.json()
        return _schemas[url]


def action_field_of(schema: Mapping[str, Any]) -> str | None:
    """The action schema's one required field besides ``metadata`` (None: not one)."""
    required = [f for f in schema.get("required", []) if f != "metadata"]
    return required[0] if len(required) == 1 else None


def observation_text(obs: Mapping[str, Any], field: str | None) -> str:
    if field is not None:
        if field not in obs:
            raise KeyError(f"observation has no field {field!r}; it has {sorted(obs)}")
        return str(obs[field])
    texts = [v for v in obs.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(dict(obs), ensure_ascii=False, sort_keys=True)


def validation_text(errors: Any) -> str:
    """pydantic's error list as ``field: message; ...`` (anything else as JSON)."""
    if isinstance(errors, list) and all(isinstance(e, dict) and "msg" in e for e in errors):
        return "; ".join(
            ".".join(str(p) for p in e.get("loc") or ()) + f": {e['msg']}" for e in errors
        )
    return json.dumps(errors, default=str)


class OpenEnvEnv(SingleAgentEnv):
    """One OpenEnv session per episode at ``url`` (``http(s)://`` or ``ws(s)://``).

    ``action_field``/``json_action``: how text becomes the action (module docstring; by
    default the schema's one required field). ``observation_field``: the text shown.
    ``reset_args``: extra fields of every reset message (the env's reset keywords).
    ``system_prompt``: what ``suggested_system_prompt`` offers (OpenEnv has none).
    ``timeout_s``: bounds connecting and each answer."""

    def __init__(
        self,
        url: str,
        action_field: str | None = None,
        observation_field: str | None = None,
        json_action: bool = False,
        reset_args: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if not url:
            raise ValueError("url is empty; give the OpenEnv server's http://host:port")
        self.url = url
        self.timeout_s = timeout_s
        self.observation_field = observation_field
        self.reset_args = dict(reset_args or {})
        self.system_prompt = system_prompt
        if json_action and action_field is not None:
            raise ValueError(f"give action_field={action_field!r} or json_action=True, not both")
        if action_field is None and not json_action:
            action_field = action_field_of(fetch_schema(url, timeout_s)["action"])
        self.action_field = action_field
        self._ws: ClientConnection | None = None
        self._obs = ""

    @property
    def suggested_system_prompt(self) -> str | None:
        return self.system_prompt

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message on the session and return its answer's ``data``; a
        ``VALIDATION_ERROR`` answer comes back as ``{"error": ...}``."""
        if self._ws is None:
            raise RuntimeError("OpenEnvEnv: step() before reset() or after the episode ended")
        try:
            self._ws.send(json.dumps(message))
            answer = json.loads(self._ws.recv(timeout=self.timeout_s))
        except (TimeoutError, WebSocketException, OSError) as e:
            self.close()
            raise ConnectionError(
                f"OpenEnv server {self.url}: no answer to {message['type']!r} ({e!r})"
            ) from e
        data: dict[str, Any] = answer.get("data") or {}
        if answer.get("type") == "error":
            if data.get("code") == "VALIDATION_ERROR":
                return {"error": data.get("errors") or data.get("message")}
            hint = (
                "; raise the server's max_concurrent_envs or lower actor.concurrency"
                if data.get("code") == "CAPACITY_REACHED"
                else ""
            )
            raise RuntimeError(
                f"OpenEnv server {self.url}: {data.get('code')}: {data.get('message')}{hint}"
            )
        return data

    def env_reset(self, *, seed: int | None = None) -> tuple[Obs, Info]:
        self.close()
        try:
            self._ws = connect(ws_url(self.url), open_timeout=self.timeout_s, max_size=None)
        except (TimeoutError, WebSocketException, OSError) as e:
            raise ConnectionError(f"OpenEnv server {self.url}: cannot connect ({e!r})") from e
        data = {**self.reset_args, **({} if seed is None else {"seed": seed})}
        answer = self._request({"type": "reset", "data": data})
        if "error" in answer:
            raise ValueError(f"OpenEnv server {self.url} rejected reset {data}: {answer['error']}")
        self._obs = observation_text(answer["observation"], self.observation_field)
        return self._obs, {"openenv_reward": answer.get("reward")}

    def _action(self, text: str) -> dict[str, Any] | str:
        """The action's fields, or why ``text`` is not an action."""
        if self.action_field is not None:
            return {self.action_field: text}
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            return f"the action must be a JSON object of the action's fields: {e}"
        if not isinstance(fields, dict):
            return f"the action must be a JSON object, not {type(fields).__name__}"
        return fields

    def env_step(self, action: str) -> StepOutcome:
        fields = self._action(action)
        answer = self._request({"type": "step", "data": fields}) if isinstance(fields, dict) else {}
        if not isinstance(fields, dict) or "error" in answer:
            why = fields if isinstance(fields, str) else validation_text(answer["error"])
            return StepOutcome(
                obs=f"Invalid action: {why}", reward=0.0, info={"invalid_action": True}
            )
        self._obs = observation_text(answer["observation"], self.observation_field)
        reward = answer.get("reward")
        done = bool(answer.get("done"))
        if done:
            self.close()
        return StepOutcome(
            obs=self._obs,
            reward=0.0 if reward is None else float(reward),
            terminated=done,
            info={"openenv_reward": reward},
        )

    async def astep(self, actions: dict[str, str]) -> dict[str, StepOutcome]:
        """``step`` in a worker thread (the socket round trip blocks)."""
        return await asyncio.to_thread(self.step, actions)

    def env_current_obs(self) -> Obs:
        return self._obs

    def close(self) -> None:
        """End the session (the server drops its environment instance)."""
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.send(json.dumps({"type": "close"}))
            except (WebSocketException, OSError):
                pass  # the server side is gone already: nothing left to release
            ws.close()
