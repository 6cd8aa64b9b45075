"""``ludic inference`` end to end: one real vLLM server (tiny model, CPU) for the module.

Tests run in file order and share the server, so versions only go up; each test reads the
current version instead of assuming one.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import free_port
from inference_server import REPO, InferenceServer
from safetensors.torch import load_file, save

from libludic.distributed.weight_sync import (
    CollectiveWeightSender,
    WeightSyncError,
    push_http,
)
from libludic.models.tiny import encode_bytes

pytestmark = pytest.mark.integration

TOKEN = "test-token-123"
PROMPT = "12+34="


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InferenceServer]:
    log = tmp_path_factory.mktemp("inference") / "server.log"
    srv = InferenceServer(tiny_model_dir, free_port(), TOKEN, log)
    srv.start()
    yield srv
    rc = srv.stop()
    assert rc == 0, f"server did not exit cleanly on SIGTERM (rc={rc}):\n{srv.tail()}"


@pytest.fixture(scope="module")
def base_sd(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model_dir / "model.safetensors"))


def random_sd(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.5 for k, v in base.items()}


def version(srv: InferenceServer) -> int:
    return int(httpx.get(srv.url + "/v1/policy_version").json()["policy_version"])


def greedy(srv: InferenceServer, n: int = 16) -> tuple[list[int], list[float], int]:
    r = httpx.post(
        srv.url + "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": n,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        },
        timeout=120,
    )
    r.raise_for_status()
    body = r.json()
    assert int(r.headers["X-Ludic-Policy-Version"]) == body["policy_version"]
    ch = body["choices"][0]
    return ch["token_ids"], ch["logprobs"]["token_logprobs"], body["policy_version"]


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ---------------------------------------------------------------------------- generation


def test_completion_token_ids_and_logprobs_match_text(
    server: InferenceServer, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    r = httpx.post(
        server.url + "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": 3,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["policy_version"] == 0 and r.headers["X-Ludic-Policy-Version"] == "0"
    assert body["prompt_token_ids"] == encode_bytes(PROMPT)  # byte tokenizer: id == byte
    ch = body["choices"][0]
    ids = ch["token_ids"]
    assert 0 < len(ids) <= 12
    assert tok.decode(ids) == ch["text"]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids)
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        # greedy: the chosen token is the most likely one, so its logprob is the top one
        assert chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)


def test_chat_completion_token_ids(server: InferenceServer, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": msgs,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["policy_version"] == version(server)
    # the tiny model's compact template: <|im_start|>u hi <|im_end|> <|im_start|>a
    expected = [257, *encode_bytes("uhi"), 258, 257, *encode_bytes("a")]
    assert body["prompt_token_ids"] == expected
    ch = body["choices"][0]
    assert len(ch["logprobs"]["content"]) == len(ch["token_ids"])
    assert tok.decode(ch["token_ids"], skip_special_tokens=True) == ch["message"]["content"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_text_decoded_once_equals_the_text_vllm_builds_token_by_token(
    server: InferenceServer, endpoint: str, skip_special: bool
) -> None:
    """A request naming logprob tokens by id runs without per-token detokenization and gets
    its text decoded once (services/inference/token_text.py): same token ids, logprobs,
    finish reasons and text as the same seeded request served token by token. Sampled at
    temperature 1 past EOS, the byte-level model writes special tokens and invalid UTF-8,
    the cases where a one-shot decode could differ from an incremental one."""
    body: dict[str, Any] = {
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 7,
        "n": 8,
        "ignore_eos": True,
        "logprobs": True if endpoint == "chat" else 0,
        "return_token_ids": True,
        "skip_special_tokens": skip_special,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = PROMPT
        path = "/v1/completions"

    def served(by_id: bool) -> list[dict[str, Any]]:
        r = httpx.post(
            server.url + path, json={**body, "return_tokens_as_token_ids": by_id}, timeout=120
        )
        assert r.status_code == 200, r.text
        return list(r.json()["choices"])

    once, stepwise = served(True), served(False)

    def text(ch: dict[str, Any]) -> str:
        return str(ch["message"]["content"] if endpoint == "chat" else ch["text"])

    def logprobs(ch: dict[str, Any]) -> list[float]:
        lp = ch["logprobs"]
        if endpoint == "chat":
            return [c["logprob"] for c in lp["content"]]
        return list(lp["token_logprobs"])

    for a, b in zip(once, stepwise, strict=True):
        assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 40
        assert a["finish_reason"] == b["finish_reason"]
        assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-5)  # batch-dependent rounding
        assert text(a) == text(b)
    assert any(text(ch) for ch in once)
    if endpoint == "chat":  # the decoded-once path leaves the chosen tokens' bytes unset
        assert all(c["bytes"] is None for ch in once for c in ch["logprobs"]["content"])
        assert all(c["bytes"] is not None for ch in stepwise for c in ch["logprobs"]["content"])


async def test_top_k_and_stop_token_ids_reach_vllm(server: InferenceServer) -> None:
    """Through the library's client: top_k=1 at temperature 1 is greedy, and the served
    (processed) logprob of a token sampled from a one-token distribution is 0; a stop token
    id ends the completion right after that token."""
    from libludic.inference.openai_client import OpenAIChatClient
    from libludic.inference.request import ChatCompletionRequest
    from libludic.inference.sampling import SamplingConfig

    msgs = [{"role": "user", "content": PROMPT}]
    client = OpenAIChatClient(server.url, coalesce=False)
    try:
        greedy_r, _ = await client.complete(
            ChatCompletionRequest(
                messages=msgs,
                sampling=SamplingConfig(temperature=0.0, max_tokens=8, ignore_eos=True),
            )
        )
        ids = greedy_r.completion_token_ids
        assert ids is not None and len(ids) == 8
        top1, _ = await client.complete(
            ChatCompletionRequest(
                messages=msgs,
                sampling=SamplingConfig(temperature=1.0, max_tokens=8, ignore_eos=True, top_k=1),
                seed=11,
            )
        )
        assert top1.completion_token_ids == ids
        assert top1.completion_logprobs == pytest.approx([0.0] * 8, abs=1e-6)
        stop = ids[3]
        first = ids.index(stop)
        stopped, _ = await client.complete(
            ChatCompletionRequest(
                messages=msgs,
                sampling=SamplingConfig(
                    temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=(stop,)
                ),
            )
        )
        assert stopped.completion_token_ids == ids[: first + 1]
        assert stopped.finish_reason == "stop"
    finally:
        await client.aclose()


async def test_a_prompt_past_the_context_is_a_400_the_client_names(server: InferenceServer) -> None:
    """A prompt longer than max_model_len (512 here) is the request's fault: 400 with vLLM's
    reason (not a 500 a client would retry), which the library's client raises as
    ContextLengthExceeded, so a multi-turn episode ends there instead of failing."""
    from libludic.inference.client import ContextLengthExceeded
    from libludic.inference.openai_client import OpenAIChatClient
    from libludic.inference.request import ChatCompletionRequest
    from libludic.inference.sampling import SamplingConfig

    long = [{"role": "user", "content": "x" * 600}]  # byte tokens: 600 > 512
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": long, "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 400 and "maximum context length" in r.text, r.text
    client = OpenAIChatClient(server.url, coalesce=False)
    try:
        with pytest.raises(ContextLengthExceeded, match="fills the model's context"):
            await client.complete(
                ChatCompletionRequest(messages=long, sampling=SamplingConfig(max_tokens=4))
            )
        ok, _ = await client.complete(  # the server is fine after it
            ChatCompletionRequest(
                messages=[{"role": "user", "content": PROMPT}],
                sampling=SamplingConfig(temperature=0.0, max_tokens=2),
            )
        )
        assert ok.completion_token_ids
    finally:
        await client.aclose()


async def test_a_coalesced_group_draws_exactly_its_separate_requests_samples(
    server: InferenceServer,
) -> None:
    """Six episodes of one group (same prompt, seeds 500..505) sent as one n=6 request draw
    the tokens (and logprobs) each episode's own request would have drawn: vLLM seeds choice
    i with seed + i, which is what the client's coalescing relies on."""
    import asyncio

    from libludic.inference.openai_client import OpenAIChatClient
    from libludic.inference.request import ChatCompletionRequest
    from libludic.inference.sampling import SamplingConfig

    reqs = [
        ChatCompletionRequest(
            messages=[{"role": "user", "content": PROMPT}],
            sampling=SamplingConfig(temperature=1.0, max_tokens=12),
            seed=500 + i,
        )
        for i in range(6)
    ]
    alone_c, group_c = OpenAIChatClient(server.url, coalesce=False), OpenAIChatClient(server.url)
    try:
        alone = [(await alone_c.complete(r))[0] for r in reqs]
        together = [r for r, _ in await asyncio.gather(*[group_c.complete(r) for r in reqs])]
    finally:
        await alone_c.aclose()
        await group_c.aclose()
    assert [a.completion_token_ids for a in alone] == [t.completion_token_ids for t in together]
    assert len({tuple(a.completion_token_ids or ()) for a in alone}) > 1  # really sampled
    for a, t in zip(alone, together):
        assert t.completion_logprobs == pytest.approx(a.completion_logprobs, abs=1e-4)


def test_streaming_chunks_carry_policy_version(server: InferenceServer) -> None:
    req = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json=req, timeout=120).json()
    chunks = []
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**req, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        assert r.headers["X-Ludic-Policy-Version"] == str(full["policy_version"])
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    assert chunks and all(c["policy_version"] == full["policy_version"] for c in chunks)
    assert (
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        == full["choices"][0]["text"]
    )


def test_models_health_and_version(server: InferenceServer) -> None:
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"] and models["data"][0]["id"]
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert httpx.get(server.url + "/v1/policy_version").json() == {
        "policy_version": 0,
        "dtype": "float32",
    }


# ---------------------------------------------------------------------------- HTTP plane


def test_http_update_bumps_version_and_changes_greedy_output(
    server: InferenceServer, base_sd: dict[str, torch.Tensor]
) -> None:
    before_ids, _, v0 = greedy(server)
    assert push_http(server.url, random_sd(base_sd, seed=1), v0 + 1, TOKEN) == v0 + 1
    after_ids, _, v1 = greedy(server)
    assert v1 == v0 + 1 == version(server)
    assert after_ids != before_ids


def _body(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.contiguous() for k, v in tensors.items()})


def _bad_requests(
    base: dict[str, torch.Tensor],
) -> dict[str, tuple[bytes, dict[str, str], int, int]]:
    """name -> (body, headers, version offset from current, expected status)."""
    good = _body(random_sd(base, seed=99))
    norm = base["model.norm.weight"]
    nan = norm.clone()
    nan[3] = float("nan")
    header_len = struct.unpack("<Q", good[:8])[0]
    return {
        "unknown_name": (_body({"model.nope.weight": norm}), auth(), 1, 422),
        "wrong_shape": (_body({"model.norm.weight": torch.ones(7)}), auth(), 1, 422),
        "wrong_dtype": (_body({"model.norm.weight": norm.to(torch.float64)}), auth(), 1, 422),
        "non_finite": (_body({"model.norm.weight": nan}), auth(), 1, 422),
        "truncated": (good[: len(good) - 100], auth(), 1, 400),
        "corrupt_header": (good[:8] + b"{" * header_len + good[8 + header_len :], auth(), 1, 400),
        "not_safetensors": (b"hello", auth(), 1, 400),
        "same_version": (good, auth(), 0, 409),
        "older_version": (good, auth(), -1, 409),
        "no_token": (good, {}, 1, 401),
        "wrong_token": (good, auth("nope"), 1, 401),
    }


def test_bad_updates_change_nothing(
    server: InferenceServer, base_sd: dict[str, torch.Tensor]
) -> None:
    ref_ids, ref_lp, v = greedy(server)
    for case, (body, headers, dv, status) in _bad_requests(base_sd).items():
        r = httpx.post(
            server.url + "/v1/weights",
            params={"version": v + dv},
            content=body,
            headers=headers,
            timeout=60,
        )
        assert r.status_code == status, f"{case}: {r.status_code} {r.text}"
        assert r.json()["detail"], case  # a reason is given
        ids, lp, v_now = greedy(server)
        assert v_now == v == version(server), case
        assert ids == ref_ids, case
        assert lp == pytest.approx(ref_lp, abs=1e-6), case


def test_partial_update_changes_only_what_it_names(
    server: InferenceServer, base_sd: dict[str, torch.Tensor]
) -> None:
    ref_ids, ref_lp, v = greedy(server)
    # One projection of a fused qkv module: the server completes it with current k/v values.
    q = torch.randn(base_sd["model.layers.1.self_attn.q_proj.weight"].shape) * 2.0
    assert (
        push_http(server.url, {"model.layers.1.self_attn.q_proj.weight": q}, v + 1, TOKEN) == v + 1
    )
    ids, lp, v1 = greedy(server)
    assert v1 == v + 1
    assert lp != pytest.approx(ref_lp, abs=1e-4)


def _stream_during_update(
    server: InferenceServer, push: Callable[[], int]
) -> tuple[list[dict[str, Any]], bool, int]:
    """Stream a 400-token greedy generation; once it is provably decoding (its first chunk
    arrived, its stream not closed), call ``push``. Returns (chunks, whether it was still
    running when the update was pushed, push's result). (Not a fixed sleep: fp32 decoding
    of the tiny model can finish 400 tokens in under a second.)"""
    result: dict[str, Any] = {"chunks": []}
    decoding = threading.Event()

    def long_generation() -> None:
        body = {
            "prompt": PROMPT,
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    result["chunks"].append(json.loads(line[len("data: ") :]))
                    decoding.set()
        result["done"] = time.monotonic()

    t = threading.Thread(target=long_generation)
    t.start()
    assert decoding.wait(60), "no chunk within 60 s"
    still_running = "done" not in result
    pushed = push()
    t.join(120)
    return result["chunks"], still_running, pushed


def test_an_update_in_flight_swaps_under_running_requests(
    server: InferenceServer, base_sd: dict[str, torch.Tensor]
) -> None:
    """update_mode=keep (default): the update does not wait for a running 400-token request;
    the request is frozen, the weights swapped, and it goes on under the new ones to its
    400th token. Its chunks carry v, then v + 1; the finished request reports the oldest
    version (v, the conservative age) and both in policy_versions."""
    v = version(server)
    chunks, still_running, pushed = _stream_during_update(
        server, lambda: push_http(server.url, random_sd(base_sd, seed=5), v + 1, TOKEN)
    )
    assert still_running and pushed == v + 1
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 400  # not cut short
    seen = [c["policy_version"] for c in chunks if c.get("choices")]
    assert seen[0] == v and v + 1 in seen  # tokens after the swap came from v + 1
    assert chunks[-1]["policy_version"] == v and chunks[-1]["policy_versions"] == [v, v + 1]
    assert greedy(server)[2] == v + 1


def test_update_mode_wait_lets_in_flight_requests_finish_on_old_weights(
    tiny_model_dir: Path, base_sd: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """update_mode=wait: the update waits for the running request (drain), so all 400 of its
    tokens come from the old weights; had it not waited, later chunks would carry v + 1."""
    srv = InferenceServer(
        tiny_model_dir, free_port(), TOKEN, tmp_path / "server.log", ["--update-mode", "wait"]
    )
    srv.start()
    try:
        chunks, still_running, pushed = _stream_during_update(
            srv, lambda: push_http(srv.url, random_sd(base_sd, seed=5), 1, TOKEN)
        )
        assert still_running and pushed == 1
        assert chunks and all(c["policy_version"] == 0 for c in chunks)
        assert "policy_versions" not in chunks[-1]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 400
        assert greedy(srv)[2] == 1
    finally:
        srv.stop()


def test_concurrent_updates_are_serialised(
    server: InferenceServer, base_sd: dict[str, torch.Tensor]
) -> None:
    v = version(server)
    sds = {v + i: random_sd(base_sd, seed=100 + i) for i in range(1, 5)}

    def push(ver: int) -> int:
        try:
            return push_http(server.url, sds[ver], ver, TOKEN)
        except WeightSyncError as e:
            assert e.status == 409, e
            return -1

    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(push, sorted(sds)))
    accepted = [g for g in got if g > 0]
    assert accepted, got
    final = version(server)
    assert final == max(accepted)
    final_ids, final_lp, _ = greedy(server)
    # The served weights are exactly the last accepted update (no tensor of another update
    # mixed in): re-pushing those weights under a new version leaves the output unchanged.
    assert push_http(server.url, sds[final], final + 1, TOKEN) == final + 1
    ids, lp, _ = greedy(server)
    assert ids == final_ids and lp == pytest.approx(final_lp, abs=1e-6)


# ---------------------------------------------------------------------------- collective plane


def test_gloo_collective_matches_http_plane(
    server: InferenceServer, base_sd: dict[str, torch.Tensor]
) -> None:
    weights = random_sd(base_sd, seed=7)
    v = version(server)
    push_http(server.url, weights, v + 1, TOKEN)
    http_ids, http_lp, _ = greedy(server)
    push_http(server.url, random_sd(base_sd, seed=8), v + 2, TOKEN)
    assert greedy(server)[0] != http_ids

    sender = CollectiveWeightSender(
        [server.url], "127.0.0.1", free_port(), token=TOKEN, backend="gloo", timeout_s=120
    )
    try:
        sender.init()
        assert sender.send(weights, v + 3) == v + 3
        ids, lp, v3 = greedy(server)
        assert v3 == v + 3
        assert ids == http_ids
        assert lp == pytest.approx(http_lp, abs=1e-6)

        # same rules as HTTP: bad name / non-finite / old version change nothing
        nan = dict(weights)
        nan["model.norm.weight"] = nan["model.norm.weight"].clone().fill_(float("inf"))
        for bad, ver, status in [
            ({"model.nope": torch.zeros(3)}, v + 4, 422),
            (nan, v + 4, 422),
            (weights, v + 3, 409),
        ]:
            with pytest.raises(WeightSyncError) as ei:
                sender.send(bad, ver)
            assert ei.value.status == status, ei.value
            assert greedy(server)[:3] == (ids, pytest.approx(lp, abs=1e-6), v + 3)
        # the group survives refusals
        assert sender.send(random_sd(base_sd, seed=9), v + 5) == v + 5
    finally:
        sender.close()


def test_collective_requires_auth(server: InferenceServer) -> None:
    body = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "backend": "gloo"}
    r = httpx.post(server.url + "/v1/weights/collective/init", json=body)
    assert r.status_code == 401
    r = httpx.post(
        server.url + "/v1/weights/collective/update",
        params={"version": 10**6},
        content=json.dumps({"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}),
        headers=auth("bad"),
    )
    assert r.status_code == 401


def test_metrics(server: InferenceServer) -> None:
    text = httpx.get(server.url + "/metrics").text
    v = version(server)
    for name in (
        "ludic_inference_requests_total",
        "ludic_inference_generated_tokens_total",
        "ludic_inference_weight_updates_total",
        "ludic_inference_weight_update_seconds_bucket",
        "ludic_inference_weight_bytes_received_total",
    ):
        assert name in text, name
    assert f"ludic_inference_policy_version {float(v)}" in text
    updates = [
        ln for ln in text.splitlines() if ln.startswith("ludic_inference_weight_updates_total{")
    ]
    for plane, outcome in [
        ("http", "ok"),
        ("http", "rejected"),
        ("http", "conflict"),
        ("collective", "ok"),
    ]:
        assert any(f'plane="{plane}"' in ln and f'outcome="{outcome}"' in ln for ln in updates), (
            plane,
            outcome,
            updates,
        )
    assert "vllm:" in text  # vLLM's own metrics are exported too


# ---------------------------------------------------------------------------- start-up errors


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "/definitely/not/here"], "does not exist"),
        (["--model", str(REPO)], "no config.json"),
        (["--model", str(REPO), "--config", "/no/such.yaml"], "does not exist"),
    ],
)
def test_startup_errors_exit_nonzero_with_one_line(args: list[str], needle: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "services.inference.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


# ---------------------------------------------------------------------------- engine death


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def test_engine_death_stops_the_server_with_exit_1(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL of vLLM's engine-core process (what an OOM kill does): the server must exit 1
    (so a restart policy brings it back), not keep answering 503 forever."""
    srv = InferenceServer(tiny_model_dir, free_port(), TOKEN, tmp_path / "server.log")
    srv.start()
    try:
        assert srv.proc is not None
        core = [c for c in children(srv.proc.pid) if "EngineCore" in cmdline(c)]
        assert core, [(c, cmdline(c)) for c in children(srv.proc.pid)]
        os.kill(core[0], signal.SIGKILL)
        rc = srv.proc.wait(60)
        assert rc == 1, srv.tail()
        assert "the vLLM engine died" in srv.tail(80)
    finally:
        srv.stop()


def test_sigterm_during_vllm_start_up_aborts_it_and_exits_0(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """vLLM builds its engine synchronously (the event loop is blocked for tens of seconds):
    a stop signal then must abort start-up at once (exit 0, engine process gone), not be
    noticed after the engine is up ("serving on" would then be logged)."""
    srv = InferenceServer(tiny_model_dir, free_port(), TOKEN, tmp_path / "server.log")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    log = open(srv.log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.inference.main", "--model", str(tiny_model_dir),
         "--host", "127.0.0.1", "--port", str(srv.port), "--insecure-no-auth"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        core: list[int] = []
        deadline = time.monotonic() + 120
        while not core and time.monotonic() < deadline and proc.poll() is None:
            core = [c for c in children(proc.pid) if "EngineCore" in cmdline(c)]
            time.sleep(0.2)
        assert core, srv.tail()  # vLLM is starting its engine core
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, srv.tail()
        text = srv.log_path.read_text(errors="replace")
        assert "stopped during start-up" in text and "serving on" not in text, srv.tail()
        deadline = time.monotonic() + 30
        while Path(f"/proc/{core[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{core[0]}").exists() or "EngineCore" not in cmdline(core[0])
    finally:
        proc.kill()
        proc.wait()
        log.close()
