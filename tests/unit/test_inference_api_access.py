"""The generation routes' access rules (services/inference/access.py): the bearer token
(LUDIC_API_KEY, or the weight token), the body cap checked before parsing, caps on n and
max_tokens, and the concurrency cap with its slot held by a stream until it ends. The app is
the real one; vLLM's serving objects are replaced by a fake that records what reached it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from services.inference.app import create_app
from services.inference.settings import InferenceSettings, SettingsError
from services.inference.worker import ParamSpec
from tests.fakes import TensorEngine


class FakeServing:
    """vLLM's completion/chat/models serving, recording each request that reached it;
    ``gate``: requests wait on it (to hold them in flight); ``stream``: answer as SSE."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.gate: asyncio.Event | None = None
        self.stream = False

    async def _answer(self, req: Any) -> Any:
        self.seen.append(req)
        if self.gate is not None:
            await self.gate.wait()
        if self.stream:

            async def sse() -> Any:
                yield 'data: {"choices": [{"text": "o", "index": 0}]}\n\n'
                yield "data: [DONE]\n\n"

            return sse()
        return SimpleNamespace(model_dump=lambda: {"choices": [{"text": "ok", "index": 0}]})

    async def create_completion(self, req: Any, raw: Any) -> Any:
        return await self._answer(req)

    async def create_chat_completion(self, req: Any, raw: Any) -> Any:
        return await self._answer(req)

    async def show_available_models(self) -> Any:
        return SimpleNamespace(model_dump=lambda: {"object": "list", "data": [{"id": "m"}]})


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save_file({"model.norm.weight": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def app(model_dir: Path, **kw: Any) -> tuple[Any, FakeServing]:
    eng = TensorEngine(ParamSpec.from_model_dir(model_dir), {"model.norm.weight": torch.zeros(4)})
    fake = FakeServing()
    eng.serving = SimpleNamespace(
        openai_serving_completion=fake, openai_serving_chat=fake, openai_serving_models=fake
    )
    return create_app(InferenceSettings(model_dir=str(model_dir), **kw), engine=eng), fake


COMPLETION = {"model": "m", "prompt": "1+1=", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_with_an_api_key_every_generation_and_read_route_takes_a_token(model_dir: Path) -> None:
    c = TestClient(app(model_dir, api_key="gen", auth_token="weights")[0])
    routes = [
        ("POST", "/v1/completions", COMPLETION),
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("GET", "/v1/policy_version", None),
    ]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "gen"}):
            r = c.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
        for token in ("gen", "weights"):  # the weight token is the stronger one
            r = c.request(method, path, json=body, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200, (path, token, r.text)
    assert c.get("/health").status_code == 200  # probes need no token
    assert 'ludic_inference_requests_total{endpoint="completions",status="401"} 3.0' in (
        c.get("/metrics").text
    )
    # the weight token on a generation route does not open the weight routes to the api key
    r = c.post("/v1/weights?version=1", content=b"x", headers={"Authorization": "Bearer gen"})
    assert r.status_code == 401


def test_without_an_api_key_the_generation_routes_stay_open(model_dir: Path) -> None:
    c = TestClient(app(model_dir)[0])
    assert c.post("/v1/completions", json=COMPLETION).status_code == 200
    assert c.get("/v1/models").status_code == 200


def test_a_body_over_the_cap_is_413_before_it_is_parsed(model_dir: Path) -> None:
    a, fake = app(model_dir, max_request_bytes=256)
    c = TestClient(a)
    big = {**COMPLETION, "prompt": "x" * 300}
    r = c.post("/v1/completions", json=big)
    assert r.status_code == 413 and "max_request_bytes=256" in r.json()["error"]["message"]
    # a body with no Content-Length is cut at the cap while it streams in
    r = c.post("/v1/completions", content=iter([json.dumps(big).encode()]))
    assert r.status_code == 413
    # not JSON at all, under the cap: 400, never a 500
    assert c.post("/v1/completions", content=b"{not json").status_code == 400
    assert fake.seen == []
    assert c.post("/v1/completions", json=COMPLETION).status_code == 200


def test_n_and_max_tokens_over_their_caps_are_400_naming_the_cap(model_dir: Path) -> None:
    a, fake = app(model_dir, max_n=4, max_tokens_limit=16)
    c = TestClient(a)
    r = c.post("/v1/completions", json={**COMPLETION, "n": 5})
    assert r.status_code == 400 and "max_n=4" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 17})
    assert r.status_code == 400 and "max_tokens_limit=16" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 99})
    assert r.status_code == 400 and "max_completion_tokens=99" in r.json()["error"]["message"]
    assert fake.seen == []
    assert c.post("/v1/completions", json={**COMPLETION, "n": 4}).status_code == 200
    # a request that names no max_tokens gets the cap, not the model's whole context
    no_max = {k: v for k, v in COMPLETION.items() if k != "max_tokens"}
    assert c.post("/v1/completions", json=no_max).status_code == 200
    assert fake.seen[-1].max_tokens == 16


async def test_past_the_concurrency_cap_a_request_is_429_until_a_slot_frees(
    model_dir: Path,
) -> None:
    a, fake = app(model_dir, max_concurrent_requests=2)
    fake.gate = asyncio.Event()
    transport = httpx.ASGITransport(app=a)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        held = [asyncio.create_task(c.post("/v1/completions", json=COMPLETION)) for _ in range(2)]
        while len(fake.seen) < 2:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "max_concurrent_requests=2" in r.json()["error"]["message"]
        fake.gate.set()
        assert [(await t).status_code for t in held] == [200, 200]
        # a stream holds its slot until its last chunk, then gives it back
        fake.stream = True
        for _ in range(3):
            r = await c.post("/v1/completions", json={**COMPLETION, "stream": True})
            assert r.status_code == 200 and "[DONE]" in r.text
        fake.stream = False
        r = await c.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200
        assert len(fake.seen) == 6


def test_the_api_key_comes_from_the_environment_or_a_file_and_bad_caps_are_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    f = tmp_path / "key"
    f.write_text("from-file\n")
    s = InferenceSettings(model_dir=str(model_dir), api_key_file=str(f))
    assert s.api_key == "from-file" and s.public_dict()["api_key"] == "<set>"
    assert "from-file" not in repr(s)
    with pytest.raises(SettingsError, match="LUDIC_API_KEY and the file"):
        InferenceSettings(model_dir=str(model_dir), api_key="other", api_key_file=str(f))
    for kw, match in [
        ({"max_n": 0}, "max_n=0 must be >= 1"),
        ({"max_request_bytes": 0}, "max_request_bytes=0"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests=0"),
        ({"max_tokens_limit": 0}, "max_tokens_limit=0"),
    ]:
        with pytest.raises(SettingsError, match=match):
            InferenceSettings(model_dir=str(model_dir), **kw)


def test_with_a_metrics_port_the_api_port_serves_no_metrics(model_dir: Path) -> None:
    """/metrics moves to its own port (services/inference/main.py serves it there), so a
    NetworkPolicy can admit scrapers to it without opening the API."""
    c = TestClient(app(model_dir, metrics_port=9100)[0])
    assert c.get("/metrics").status_code == 404
    assert TestClient(app(model_dir)[0]).get("/metrics").status_code == 200
    with pytest.raises(SettingsError, match="is the API port"):
        InferenceSettings(model_dir=str(model_dir), metrics_port=8000)


async def test_the_metrics_port_renders_the_inference_metrics() -> None:
    from services.common.http import start_http
    from services.inference.metrics import InferenceMetrics
    from services.launcher.stack import free_port

    m = InferenceMetrics()
    m.policy_version.set(7)
    port = free_port()
    server = await start_http(port, host="127.0.0.1", render=m.render)
    assert server is not None
    try:
        async with httpx.AsyncClient() as c:
            r = await c.get(f"http://127.0.0.1:{port}/metrics")
        assert r.status_code == 200 and "ludic_inference_policy_version 7.0" in r.text
    finally:
        server.close()
