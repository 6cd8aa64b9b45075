"""Checkpoints: bit-identical resume, torn checkpoints skipped, retention, RNG."""

from __future__ import annotations

import copy
import json
import logging
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.training.checkpoint import CheckpointConfig, CheckpointManager
from libludic.training.config import TrainerConfig
from libludic.training.presets import make_sft
from libludic.training.trainer import Trainer
from tests.fakes import ListBatchSource, make_item, ticks_during


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def batches():
    return [[make_item(4 + b, 3, seed=10 * b + i) for i in range(3)] for b in range(4)]


def trainer(model, ckpt_dir=None, every=0):
    mgr = (
        CheckpointManager(CheckpointConfig(str(ckpt_dir), every_n_steps=every))
        if ckpt_dir
        else None
    )
    return Trainer(
        model=copy.deepcopy(model),
        algo=make_sft(),
        batch_source=ListBatchSource(batches()),
        cfg=TrainerConfig(
            model_device="cpu", mixed_precision_dtype=None, lr=1e-2, pad_token_id=PAD_ID
        ),
        checkpointer=mgr,
    )


async def test_resume_is_bit_identical(base_model, tmp_path) -> None:
    straight = trainer(base_model)
    await straight.train(num_steps=4)

    first = trainer(base_model, tmp_path / "ck", every=2)
    await first.train(num_steps=2)  # checkpoint written automatically at step 2
    assert (tmp_path / "ck" / "step_000000002" / "COMPLETE").exists()

    resumed = trainer(base_model, tmp_path / "ck")
    ck = resumed.load_checkpoint()
    assert ck is not None and ck.step == 2 and ck.extra["batch_source"] == {"pos": 2}
    assert resumed.step == 2 and resumed.batch_source.pos == 2
    # the throughput totals go on from the checkpoint: samples/s covers the whole run
    assert resumed.throughput.items_trained_total == first.throughput.items_trained_total == 6
    # (less the time of writing it)
    assert 0 < resumed.throughput.rl_wall_s <= first.throughput.rl_wall_s
    assert resumed.throughput.tokens_trained_total == first.throughput.tokens_trained_total
    await resumed.train(num_steps=2)
    assert resumed.throughput.items_trained_total == 12

    for (n, p), q in zip(
        straight.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(p, q), n
    sa, sb = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    for pid in sa["state"]:
        for k, v in sa["state"][pid].items():
            assert torch.equal(v, sb["state"][pid][k]), (pid, k)


def test_rng_state_round_trips(tmp_path) -> None:
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path)))
    torch.manual_seed(3)
    random.seed(4)
    mgr.save(1, {"w": torch.zeros(2)})
    want = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    mgr.load()
    got = (torch.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and want[1] == got[1]


def test_torn_checkpoints_are_skipped(tmp_path, caplog) -> None:
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path), max_to_keep=None))
    for s in (1, 2, 3, 4):
        mgr.save(s, {"w": torch.full((4,), float(s))}, extra={"s": s})
    (tmp_path / "step_000000004" / "COMPLETE").unlink()  # crashed before the marker
    with open(tmp_path / "step_000000003" / "model.safetensors", "r+b") as f:
        f.truncate(10)  # torn file: size differs from the manifest
    (tmp_path / "step_000000002" / "manifest.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        ck = mgr.load()
    assert ck is not None and ck.step == 1 and ck.extra == {"s": 1}
    assert torch.equal(ck.model_state["w"], torch.full((4,), 1.0))
    text = caplog.text
    assert "no COMPLETE marker" in text and "manifest says" in text and "bad manifest.json" in text
    with pytest.raises(ValueError, match="torn"):
        mgr.load(tmp_path / "step_000000004")


def test_keeps_n_newest_and_temp_dirs_are_ignored(tmp_path) -> None:
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path), max_to_keep=2))
    for s in (1, 2, 3):
        mgr.save(s, {"w": torch.zeros(1)})
    (tmp_path / ".tmp-step_000000009-dead").mkdir()  # a writer died mid-save
    assert [p.name for p in mgr.list_checkpoints()] == ["step_000000002", "step_000000003"]
    assert mgr.latest().name == "step_000000003"
    m = json.loads((tmp_path / "step_000000003" / "manifest.json").read_text())
    assert m["step"] == 3 and set(m["files"]) == {"model.safetensors", "rng.safetensors"}


def test_empty_dir_loads_none_and_config_validation(tmp_path) -> None:
    assert CheckpointManager(CheckpointConfig(str(tmp_path / "none"))).load() is None
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointConfig(str(tmp_path), max_to_keep=0)
    c = CheckpointConfig("x")
    assert (c.every_n_steps, c.max_to_keep, c.save_optimizer) == (0, 2, True)


async def test_a_checkpoint_is_written_off_the_event_loop(base_model, tmp_path) -> None:
    """A save that takes a while (a big model, a slow disk) must not stop the service's
    other tasks (/health, /metrics): a ticker on the loop keeps ticking through it."""
    import time

    tr = trainer(base_model, tmp_path / "ck", every=100)
    save = tr.checkpointer.save

    def slow_save(*a, **kw):
        time.sleep(0.6)
        return save(*a, **kw)

    tr.checkpointer.save = slow_save
    await tr.train(num_steps=1)
    path, ticks = await ticks_during(tr.checkpoint(), 0.02)
    assert path is not None and (path / "COMPLETE").exists()
    # 0.6 s of saving at one tick per 20 ms: ~30 ticks (a blocked loop: 0); 10 leaves
    # room for a loaded machine
    assert ticks >= 10, ticks
