"""feeder -> actor -> credit through a real redis-server; the SAWItems' action logprobs
must be the sampling policy's log pi(token | prefix), recomputed here with the model.

The default test runs the tiny model in-process (HFChatClient). The ``vllm`` test runs
the same pipeline against a real `ludic inference` server; run it alone (one vLLM server at
a time: two compete for a CPU host's cores): ``pytest -m vllm tests/integration/test_pipeline.py``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from libludic import transport as t
from services.actor import main as actor_main
from services.credit import main as credit_main
from services.feeder import main as feeder_main
from services.feeder import worker as feeder_worker

try:  # tests/ is on sys.path under pytest's default import mode
    from conftest import free_port  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    from tests.conftest import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
GROUPS, GROUP_SIZE = 2, 3

TASKS = [
    {
        "name": "add",
        "env": {"kind": "arithmetic", "kwargs": {"digits": 1}},
        "protocol": {"kind": "single_agent"},
        "inference": {"sampling": {"temperature": 1.0, "max_tokens": 6}},
    }
]


def recompute_logprobs(model_dir: Path, input_ids: Any) -> list[float]:
    """log_softmax(logits[i-1])[input_ids[i]] for every position i >= 1 (0.0 at i = 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    input_ids = [int(i) for i in input_ids]  # a decoded item's ids are a numpy array
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([input_ids])).logits[0].float()  # [T, V]
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(input_ids[1:])[:, None])[:, 0]
    return [0.0] + lp.tolist()


async def run_pipeline(
    redis_url: str, run_id: str, client: Any = None, urls: Any = None, api_key: str | None = None
) -> list[Any]:
    keys = t.Keys(run_id)
    r = t.connect(redis_url)
    fs = feeder_worker.FeederSettings(
        redis_url=redis_url,
        run_id=run_id,
        tasks=TASKS,
        algorithm={"group_size": GROUP_SIZE},
        high_water=GROUPS,
        max_requests=GROUPS,
        metrics_port=0,
        poll_s=0.1,
        max_head_offpolicyness=None,  # no learner here to admit generation
    )
    a_s = actor_main.ActorSettings(
        redis_url=redis_url,
        run_id=run_id,
        metrics_port=0,
        max_head_offpolicyness=1,
        block_ms=200,
        concurrency=2,
        tasks=TASKS,
        inference_urls=urls or ["http://unused"],
        api_key=api_key,
    )
    c_s = credit_main.CreditSettings(
        redis_url=redis_url,
        run_id=run_id,
        algorithm={"name": "grpo", "group_size": GROUP_SIZE},
        metrics_port=0,
        block_ms=200,
    )
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(feeder_main.run(fs, stop=stop)),
        asyncio.create_task(actor_main.run(a_s, client=client, stop=stop)),
        asyncio.create_task(credit_main.run(c_s, stop=stop)),
    ]
    deadline = time.monotonic() + 240
    while await r.xlen(keys.saw) < GROUPS * GROUP_SIZE and time.monotonic() < deadline:
        assert await r.xlen(keys.deadletter) == 0, await r.xrange(keys.deadletter)
        for tk in tasks:
            if tk.done() and tk.exception():
                raise tk.exception()  # type: ignore[misc]
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    items = [t.decode_saw_item(f[b"d"]) for _, f in await r.xrange(keys.saw)]
    assert await r.xlen(keys.requests) == 0 and await r.xlen(keys.rollouts) == 0
    assert await r.xlen(keys.deadletter) == 0
    await r.aclose()
    return items


def check_items(items: list[Any], model_dir: Path, atol: float) -> None:
    assert len(items) == GROUPS * GROUP_SIZE
    groups = {it.meta["group_id"] for it in items}
    assert len(groups) == GROUPS
    for g in groups:  # GRPO: weights are R_i - mean(R) within the group -> sum to 0
        assert sum(it.weight for it in items if it.meta["group_id"] == g) == pytest.approx(
            0, abs=1e-6
        )
    for it in items:
        ref = recompute_logprobs(model_dir, it.input_ids)
        act = [i for i, m in enumerate(it.action_mask) if m]
        assert act and act[-1] == len(it.input_ids) - 1
        assert all(
            it.attachments.actor_logprobs[i] == 0.0 for i, m in enumerate(it.action_mask) if not m
        )
        got = [it.attachments.actor_logprobs[i] for i in act]
        want = [ref[i] for i in act]
        assert got == pytest.approx(want, abs=atol), (it.meta, got, want)


async def test_pipeline_hf_in_process(redis_url: str, tiny_model_dir: Path) -> None:
    from libludic.inference.hf_client import HFChatClient

    client = HFChatClient(tiny_model_dir)
    items = await run_pipeline(redis_url, "pipe", client=client)
    # float32 on the wire; batched KV-cached generation vs one full forward: ~1e-5 apart
    check_items(items, tiny_model_dir, atol=1e-4)


@pytest.mark.vllm
@pytest.mark.slow
async def test_pipeline_real_vllm(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "LUDIC_AUTH_TOKEN": "test-token",
        "LUDIC_API_KEY": "gen-token",  # the generation routes take it: the actor sends it
    }
    log = open(tmp_path / "inference.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "inference",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--enforce-eager",
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 600
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline:
                assert proc.poll() is None, (tmp_path / "inference.log").read_text()[-3000:]
                try:
                    if (await http.get(f"{url}/health", timeout=2)).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(2)
            else:
                raise AssertionError("ludic inference did not become healthy in 600 s")
            body = {"prompt": "1+1=", "max_tokens": 2}
            assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 401
        items = await run_pipeline(redis_url, "pipev", urls=[url], api_key="gen-token")
        # vLLM's CPU kernels vs transformers' forward: same weights, different kernels
        check_items(items, tiny_model_dir, atol=2e-2)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_feeder_cli_restart_never_repeats_seeds_and_status_reports(
    redis_url: str, tmp_path: Path
) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"redis_url: {redis_url}\nrun_id: cli\n"
        "max_head_offpolicyness: null\n"  # no learner here to admit generation
        "algorithm: {group_size: 4}\nfeeder:\n  high_water: 100\n  max_requests: 3\n  metrics_port: 0\n"
        "  poll_s: 0.05\n  tasks:\n"
        "    - {name: add, weight: 3, env: {kind: arithmetic, kwargs: {digits: 1}}}\n"
        "    - {name: ttt, weight: 1, env: {kind: tic_tac_toe}}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "LUDIC_CONFIG": str(cfg)}
    for _ in range(2):  # a restart continues from the persisted seed counter
        subprocess.run(
            [sys.executable, "-m", "services.cli", "feeder"],
            cwd=REPO,
            env=env,
            check=True,
            timeout=60,
            capture_output=True,
        )

    async def read() -> list[Any]:
        r = t.connect(redis_url)
        out = [t.decode_request(f[b"d"]) for _, f in await r.xrange(t.Keys("cli").requests)]
        await r.aclose()
        return out

    reqs = asyncio.run(read())
    assert [q.env_seed for q in reqs] == [0, 1, 2, 3, 4, 5]
    assert all(q.num_episodes == 4 and q.same_env_seed and q.meta["group_id"] == q.id for q in reqs)
    assert all(q.inference is None or q.inference.return_spec.return_chosen_logprobs for q in reqs)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "status",
            "--json",
            "--redis-url",
            redis_url,
            "--run-id",
            "cli",
        ],
        cwd=REPO,
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
    )
    import json

    st = json.loads(out.stdout)
    assert st["streams"]["requests"]["length"] == 6
    assert st["feeder_next_seed"] == 6 and st["actors_alive"] == 0 and st["policy_version"] == 0
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "status",
            "--redis-url",
            redis_url,
            "--run-id",
            "cli",
        ],
        cwd=REPO,
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout
    assert "requests" in text and "policy_version=0" in text
