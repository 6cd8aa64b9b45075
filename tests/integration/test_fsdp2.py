"""FSDP2 on CPU (gloo) under torchrun: ranks agree, and equal single-process training."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(
    "split,algo", [("even", "sft"), ("uneven", "sft"), ("even", "kl"), ("even", "ppo")]
)
def test_fsdp2_two_ranks_match_single_process(tiny_model_dir, tmp_path, split, algo) -> None:
    """``uneven``: rank 0 holds one item (one micro-batch) and rank 1 seven (several); each
    micro-batch's forward and backward are collectives, so both must run as many. Rank 1
    passes the model on the meta device (fsdp2_worker.py): its shards hold rank 0's weights
    or the step would differ from one process's. ``kl``: the frozen reference is sharded
    and filled the same way. ``ppo``: so is the critic (built from rank 1's meta model), and
    its step, GAE over each rank's rollouts included, equals one process's."""
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[1]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(HERE / "fsdp2_worker.py"),
            str(tiny_model_dir),
            str(out),
            split,
            algo,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r0, r1 = load_file(str(out / "rank0.safetensors")), load_file(str(out / "rank1.safetensors"))
    s0 = json.loads((out / "rank0.json").read_text())
    s1 = json.loads((out / "rank1.json").read_text())
    assert s0["world"] == 2 and s0["dtensor_params"] > 0  # really sharded
    if split == "even":
        assert s0["num_items"] == s1["num_items"] == 4
    else:
        assert (s0["num_items"], s1["num_items"]) == (1, 7)
    sys.path.insert(0, str(HERE))
    try:
        import fsdp2_worker as w
    finally:
        sys.path.remove(str(HERE))
    from libludic.training.collate import pack_micro_batches

    packed = [
        len(pack_micro_batches(w.share(r, 2, split), w.config().micro_token_budget, None))
        for r in (0, 1)
    ]
    if split == "uneven":
        assert packed[0] < packed[1]  # the case under test: the ranks packed different counts
    assert s0["num_micro_batches"] == s1["num_micro_batches"] == max(packed)
    # rank 0 sent the publish, rank 1 learnt its outcome from rank 0
    assert s0["policy_version"] == s1["policy_version"] == 1
    assert [v for v, _ in s0["publish_calls"]] == [1] and s1["publish_calls"] == []
    # publishing gathers onto rank 0 only: rank 1 took part and kept nothing
    assert s0["rank0_only_ok"] and s1["rank0_only_ok"]
    assert s0["tied_once"] and s1["tied_once"]
    # both ranks gathered the same full parameters, bit for bit
    assert sorted(r0) == sorted(r1)
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k

    # reference: one process training on the union of both ranks' items
    from transformers import AutoModelForCausalLM

    from libludic.training.trainer import Trainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ref = Trainer(
        model=model,
        algo=w.algorithm(algo),
        batch_source=w.Fixed(w.fixed_items()),
        cfg=w.config(),
    )
    stats = asyncio.run(ref.train_step())
    if algo == "kl":
        assert s0["ref_dtensor_params"] > 0 and s1["ref_dtensor_params"] > 0
        # at the first step the reference is the policy: KL 0 on every rank, as in one process
        # (a reference shard left unfilled on rank 1 would make it large)
        assert stats["loss/kl/kl"] == pytest.approx(0.0, abs=1e-6)
        assert s0["kl"]["loss/kl/kl"] == pytest.approx(0.0, abs=1e-6)
        assert s1["kl"]["loss/kl/kl"] == pytest.approx(0.0, abs=1e-6)
    if algo == "ppo":
        assert s0["critic_dtensor_params"] > 0 and s1["critic_dtensor_params"] > 0
        # each rank holds whole rollouts (even split: items i and i + 4 share rollout i % 4,
        # and rank r holds items r::2), so GAE per rank is GAE over the batch
        assert s0["adv"] == pytest.approx([stats["adv_mean"], stats["adv_std"]], rel=1e-5)
        assert s1["adv"] == pytest.approx(s0["adv"], rel=1e-6)
        c0 = load_file(str(out / "rank0_critic.safetensors"))
        c1 = load_file(str(out / "rank1_critic.safetensors"))
        one = dict(ref.critic.model.state_dict())
        assert sorted(c0) == sorted(c1) == sorted(one)
        for k in c0:
            assert torch.equal(c0[k], c1[k]), k
            torch.testing.assert_close(c0[k], one[k], rtol=1e-3, atol=1e-4, msg=k)
        # the critic moved: its head starts at 0
        assert c0["value_head.bias"].abs().item() > 0
    # the global normaliser (all-reduced) makes each rank's loss its share of the full-batch
    # loss; the Trainer sums the shares over ranks, so every rank reports the full-batch loss
    assert s0["loss"] == pytest.approx(stats["loss"], rel=1e-5)
    assert s1["loss"] == pytest.approx(stats["loss"], rel=1e-5)
    assert s0["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    sd = ref.full_state_dict()
    assert sorted(sd) == sorted(r0)
    # Adam's first step is ~lr * sign(g): entries whose gradient is within float rounding
    # of 0 move by a rounding-sized amount that differs between the two reduction orders,
    # so compare at 1e-4 (the step itself is lr = 1e-2)
    for k in sd:
        torch.testing.assert_close(r0[k], sd[k], rtol=1e-3, atol=1e-4, msg=k)
    assert not torch.equal(
        sd["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"]
    )
