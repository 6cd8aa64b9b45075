"""Transport throughput: SAWItems through the library (encode, XADD, read, decode, ack) vs raw redis-py.

For SAWItems of 512 and 4096 tokens (ids int32, masks uint8, logprobs float32 packed):

* ``transport``: a producer encodes each item (``encode_saw_item``) and XADDs it in
  pipelined batches (respecting a high-water mark); a consumer (``StreamConsumer``) reads
  batches with XREADGROUP, decodes every item and XACK+XDELs it. Items/s and MB/s count
  payload bytes end to end; latency is encode-start -> decoded-by-consumer per item.
* ``raw``: redis-py doing the same work on the same pre-encoded bytes: pipelined XADD in
  the same batches under the same backpressure, XREADGROUP in the same group with the same
  count, XACK + XDEL in one transaction; no encode, no decode, no library code.

``ratio = transport items/s / raw items/s`` (higher is better; 1.0 = the codec and the
library cost nothing on top of Redis round trips). Starts its own redis-server (no persistence) on a free port.
``--quick`` runs in well under 60 s. Last line: ``RESULT transport ...`` (512 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libludic import transport as t  # noqa: E402
from libludic.saw import SampleAttachments, SAWItem  # noqa: E402
from services.launcher.stack import free_port  # noqa: E402

BATCH = 32


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("bench/transport.py needs redis-server on PATH")
    port = free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


def make_item(n_tokens: int, rng: np.random.Generator) -> SAWItem:
    n_act = n_tokens // 4
    return SAWItem(
        input_ids=rng.integers(0, 50_000, n_tokens).tolist(),
        attention_mask=[1] * n_tokens,
        action_mask=[0] * (n_tokens - n_act) + [1] * n_act,
        weight=0.5,
        meta={"item_id": "x", "group_id": "g", "reward": 1.0},
        attachments=SampleAttachments(
            actor_logprobs=[0.0] * (n_tokens - n_act) + (-rng.random(n_act)).tolist(),
            policy_version=3,
        ),
    )


async def bench_transport(url: str, n_tokens: int, n_items: int) -> dict[str, float]:
    r = t.connect(url)
    stream = f"ludic:{{bench}}:saw{n_tokens}"
    await r.delete(stream)
    await t.ensure_group(r, stream, "g")
    item = make_item(n_tokens, np.random.default_rng(0))
    sent: dict[str, float] = {}
    lat: list[float] = []
    nbytes = 0
    c = t.StreamConsumer(r, stream, "g", "c1", "ludic:{bench}:deadletter", claim_every_s=1e9)

    async def produce() -> None:
        nonlocal nbytes
        for start in range(0, n_items, BATCH):
            await t.wait_below(r, stream, 4 * BATCH * 8, poll_s=0.001)
            pipe = r.pipeline(transaction=False)
            for i in range(start, min(n_items, start + BATCH)):
                iid = str(i)
                sent[iid] = time.perf_counter()
                item.meta["item_id"] = iid
                payload = t.encode_saw_item(item)
                nbytes += len(payload)
                pipe.xadd(stream, {"id": iid, "d": payload})
            await pipe.execute()

    async def consume() -> None:
        got = 0
        while got < n_items:
            entries = await c.read(BATCH * 4, block_ms=1000)
            for e in entries:
                it = t.decode_saw_item(e.payload)
                lat.append(time.perf_counter() - sent[it.item_id])
            await c.ack(entries)
            got += len(entries)

    t0 = time.perf_counter()
    await asyncio.gather(produce(), consume())
    dt = time.perf_counter() - t0
    assert await r.xlen(stream) == 0
    await r.aclose()
    lat_ms = np.array(lat) * 1000
    return {
        "items_per_s": n_items / dt,
        "mb_per_s": nbytes / dt / 1e6,
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
        "bytes": nbytes / n_items,
    }


async def bench_raw(url: str, payload: bytes, n_items: int) -> dict[str, float]:
    """Raw redis-py doing the same work on the same bytes: a producer pipelining XADD in
    batches of BATCH under the same backpressure, a consumer in the same group reading
    BATCH * 4 with XREADGROUP and acking with XACK + XDEL in one transaction; no encode, no
    decode, no library."""
    r = t.connect(url)
    stream = "ludic:{bench}:raw"
    await r.delete(stream)
    await r.xgroup_create(stream, "g", id="0", mkstream=True)

    async def produce() -> None:
        for start in range(0, n_items, BATCH):
            while await r.xlen(stream) >= 4 * BATCH * 8:
                await asyncio.sleep(0.001)
            pipe = r.pipeline(transaction=False)
            for i in range(start, min(n_items, start + BATCH)):
                pipe.xadd(stream, {"id": str(i), "d": payload})
            await pipe.execute()

    async def consume() -> None:
        got = 0
        while got < n_items:
            reply = await r.xreadgroup("g", "c1", {stream: ">"}, count=BATCH * 4, block=1000)
            ids = [eid for _, entries in reply or [] for eid, _ in entries]
            if ids:
                pipe = r.pipeline(transaction=True)
                pipe.xack(stream, "g", *ids)
                pipe.xdel(stream, *ids)
                await pipe.execute()
            got += len(ids)

    t0 = time.perf_counter()
    await asyncio.gather(produce(), consume())
    dt = time.perf_counter() - t0
    assert await r.xlen(stream) == 0
    await r.delete(stream)
    await r.aclose()
    return {"items_per_s": n_items / dt, "mb_per_s": len(payload) * n_items / dt / 1e6}


async def main_async(quick: bool) -> None:
    counts = {512: 3000, 4096: 800} if quick else {512: 30000, 4096: 8000}
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(tmp)
        try:
            results = {}
            for n_tok, n in counts.items():
                payload = t.encode_saw_item(make_item(n_tok, np.random.default_rng(0)))
                await bench_raw(url, payload, min(n, 500))  # warm-up
                tr = await bench_transport(url, n_tok, n)
                raw = await bench_raw(url, payload, n)
                ratio = tr["items_per_s"] / raw["items_per_s"]
                results[n_tok] = (tr, raw, ratio)
                print(
                    f"tokens={n_tok:<5} bytes/item={tr['bytes']:.0f}  transport: "
                    f"{tr['items_per_s']:.0f} items/s {tr['mb_per_s']:.1f} MB/s "
                    f"p50={tr['p50_ms']:.2f} ms p99={tr['p99_ms']:.2f} ms | raw redis-py: "
                    f"{raw['items_per_s']:.0f} items/s {raw['mb_per_s']:.1f} MB/s | "
                    f"ratio={ratio:.2f}",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(10)
    tr, raw, ratio = results[512]
    print(
        f"RESULT transport items_per_s={tr['items_per_s']:.0f} mb_per_s={tr['mb_per_s']:.2f} "
        f"p99_ms={tr['p99_ms']:.2f} ratio={ratio:.2f}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts, < 60 s")
    a = p.parse_args()
    asyncio.run(main_async(a.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
