"""Trainer.train is the one RL loop: publish with a version floor and a failure
policy, commit of the source's trained items (after each step, or only inside checkpoints),
stop conditions, and hooks, on the tiny model with fakes for the source and the publisher."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from libludic.distributed.publisher import PublishError
from libludic.models.tiny import PAD_ID
from libludic.saw import SAWBatch
from libludic.training.checkpoint import CheckpointConfig, CheckpointManager
from libludic.training.config import TrainerConfig
from libludic.training.presets import make_sft
from libludic.training.publishing import PublishFailed
from libludic.training.trainer import Trainer, TrainerHooks
from libludic.training.types import (
    CheckpointedBatchSource,
    CommittingBatchSource,
    SourceStopped,
)
from tests.fakes import ListBatchSource, make_item


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


class CommittingSource:
    """Batches of 2 items; records mark_trained / commit like PipelineBatchSource; raises
    SourceStopped after ``stop_after`` batches (None: never)."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.n = 0
        self.stop_after = stop_after
        self.handed: list[str] = []
        self.trained: list[str] = []
        self.committed: list[str] = []
        self.stale_dropped = 3  # dropped before batching: the Trainer reports it

    async def next_batch(self) -> SAWBatch:
        if self.stop_after is not None and self.n >= self.stop_after:
            raise SourceStopped()
        self.n += 1
        items = [make_item(4, 2, seed=10 * self.n + i) for i in range(2)]
        for i, it in enumerate(items):
            it.meta["item_id"] = f"b{self.n}-{i}"
        self.handed = [it.item_id for it in items]
        return SAWBatch(items=items)

    def mark_trained(self) -> list[str]:
        ids, self.handed = self.handed, []
        self.trained += ids
        return ids

    async def commit(self) -> int:
        new = [i for i in self.trained if i not in self.committed]
        self.committed += new
        return len(new)


class Publisher:
    def __init__(self, fail: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.fail = set(fail)
        self.calls: list[int] = []
        self.n = 0

    def publish(self, state_dict: Any, version: int | None) -> None:
        self.n += 1
        self.calls.append(int(version or 0))
        if self.n in self.fail:
            raise PublishError(int(version or 0), {"http://r": "HTTP 503"})


def cfg(**kw: Any) -> TrainerConfig:
    return TrainerConfig(model_device="cpu", mixed_precision_dtype=None, pad_token_id=PAD_ID, **kw)


def trainer(model: Any, source: Any, **kw: Any) -> Trainer:
    return Trainer(model=copy.deepcopy(model), algo=make_sft(), batch_source=source, **kw)


async def test_versions_start_above_the_floor_and_a_failed_publish_number_is_never_reused(
    base_model,
) -> None:
    seen: list[tuple[int, str | None]] = []

    async def on_publish(version: int, error: str | None, secs: float) -> None:
        seen.append((version, error))

    pub = Publisher(fail={2})
    tr = trainer(
        base_model,
        CommittingSource(),
        publisher=pub,
        cfg=cfg(),
        hooks=TrainerHooks(on_publish=on_publish),
    )
    tr.publishing.raise_floor(7)  # Redis or a replica already serves v7
    await tr.train(num_steps=3)
    # step 1 -> v8; step 2's v9 fails (v8 stays served); step 3 publishes v10: a replica that
    # took v9 before failing to answer must not be told v9 again for other weights
    assert tr.policy_version == 8  # v10 is still in flight (async_publish)
    assert await tr.finish_publish() is True and await tr.finish_publish() is None
    assert pub.calls == [8, 9, 10]
    assert tr.policy_version == 10 and tr.publishing.failures == 1
    assert tr.publishing.consecutive_failures == 0 and tr.publishing.last_step == 3
    assert [v for v, _ in seen] == [8, 9, 10] and seen[1][1] is not None and "503" in seen[1][1]


@pytest.mark.parametrize("async_publish, failed_at_step", [(False, 3), (True, 4)])
async def test_max_publish_failures_in_a_row_raise(
    base_model, async_publish: bool, failed_at_step: int
) -> None:
    # in the background, a publish's failure is known when the next one starts: one step later
    tr = trainer(
        base_model,
        CommittingSource(),
        publisher=Publisher(fail={1, 2, 3}),
        cfg=cfg(max_publish_failures=3, async_publish=async_publish),
    )
    with pytest.raises(PublishFailed, match="3 consecutive publishes failed"):
        await tr.train(num_steps=5)
    assert tr.step == failed_at_step and tr.policy_version == 0


async def test_a_background_publish_sends_the_weights_of_its_step_while_training_goes_on(
    base_model,
) -> None:
    """The publish of step 1 is sent while step 2 trains: the publisher receives the weights
    as they were after step 1 (a snapshot), and the served version moves only when the
    publish is finished."""
    import threading

    release = threading.Event()
    got: dict[int, dict[str, torch.Tensor]] = {}

    class Slow:
        def publish(self, state_dict: Any, version: int | None) -> None:
            got[int(version or 0)] = {k: v.clone() for k, v in state_dict.items()}
            release.wait(30)

    tr = trainer(base_model, CommittingSource(), publisher=Slow(), cfg=cfg(lr=1e-2))
    await tr.train_step()
    after_step1 = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    assert tr.policy_version == 0  # v1 in flight
    step2 = asyncio.ensure_future(tr.train_step())
    await asyncio.sleep(0.2)  # step 2 trains, then waits in start_publish for v1
    assert not step2.done() and tr.step == 2
    release.set()
    stats = await step2
    assert tr.policy_version == 1 and stats["publish_wait_s"] > 0.1
    moved = [k for k in after_step1 if not torch.equal(tr.model.state_dict()[k], after_step1[k])]
    assert moved  # step 2 changed the live weights...
    for k, v in got[1].items():  # ...but not what was published for step 1
        torch.testing.assert_close(v, after_step1[k], rtol=0, atol=0, msg=k)
    await tr.finish_publish()
    assert tr.policy_version == 2


async def test_without_checkpoints_each_step_commits_its_items(base_model) -> None:
    src = CommittingSource()
    steps: list[tuple[float, list[str]]] = []

    async def on_step(stats: dict[str, float], ids: list[str]) -> None:
        steps.append((stats["batch_items"], ids))
        assert src.committed == src.trained  # committed before the hook runs

    recorded: list[str] = []

    async def on_trained(step: int, ids: list[str]) -> None:
        # the record of trained items comes before their commit (a kill -9 in between must
        # not leave committed items unrecorded)
        assert not set(ids) & set(src.committed)
        recorded.extend(ids)

    tr = trainer(
        base_model, src, cfg=cfg(), hooks=TrainerHooks(on_step=on_step, on_trained=on_trained)
    )
    hist = await tr.train(num_steps=2)
    assert recorded == src.committed
    assert src.committed == ["b1-0", "b1-1", "b2-0", "b2-1"]
    assert steps == [(2.0, ["b1-0", "b1-1"]), (2.0, ["b2-0", "b2-1"])]
    assert hist[-1]["stale_dropped_total"] == 3.0


async def test_with_checkpoints_items_commit_only_inside_a_checkpoint(base_model, tmp_path) -> None:
    src = CommittingSource()
    saved: list[int] = []

    async def on_checkpoint(path: Any, committed: int) -> None:
        saved.append(committed)

    mgr = CheckpointManager(CheckpointConfig(str(tmp_path), every_n_steps=2))
    tr = trainer(
        base_model,
        src,
        cfg=cfg(),
        checkpointer=mgr,
        hooks=TrainerHooks(on_checkpoint=on_checkpoint),
    )
    await tr.train(num_steps=1)
    assert src.trained == ["b1-0", "b1-1"] and src.committed == []  # no checkpoint yet
    await tr.train(num_steps=2)  # the checkpoint at step 2 commits steps 1-2; step 3 waits
    assert src.committed == ["b1-0", "b1-1", "b2-0", "b2-1"] and saved == [4]
    assert await tr.checkpoint() is not None  # explicit (final) checkpoint of step 3
    assert src.committed == src.trained and saved == [4, 2]
    assert await tr.checkpoint() is None  # this step has one already


async def test_stop_conditions(base_model) -> None:
    tr = trainer(base_model, CommittingSource(stop_after=2), cfg=cfg())
    hist = await tr.train()  # until stopped: the source stops after 2 batches
    assert len(hist) == 2 and tr.stop_reason == "stopped"
    tr2 = trainer(base_model, CommittingSource(), cfg=cfg())
    assert await tr2.train(num_steps=2) and tr2.stop_reason == "done"
    flag = {"stop": False}

    async def on_step(stats: dict[str, float], ids: list[str]) -> None:
        flag["stop"] = stats["step"] >= 3

    tr3 = trainer(base_model, CommittingSource(), cfg=cfg(), hooks=TrainerHooks(on_step=on_step))
    hist3 = await tr3.train(num_steps=10, should_stop=lambda: flag["stop"])
    assert len(hist3) == 3 and tr3.stop_reason == "stopped"


def test_the_committing_contract_is_recognised_by_its_protocol() -> None:
    assert isinstance(CommittingSource(), CommittingBatchSource)
    assert not isinstance(ListBatchSource([]), CommittingBatchSource)
    assert isinstance(ListBatchSource([]), CheckpointedBatchSource)


def test_a_source_with_part_of_a_contract_is_refused_by_name(base_model) -> None:
    class CommitsOnly:  # its items would never be marked trained, so never committed
        async def next_batch(self) -> SAWBatch:
            return SAWBatch(items=[])

        async def commit(self) -> int:
            return 0

    class SavesOnly:  # its state would be saved and never restored
        async def next_batch(self) -> SAWBatch:
            return SAWBatch(items=[])

        def state_dict(self) -> dict[str, int]:
            return {}

    with pytest.raises(TypeError, match=r"CommitsOnly has \['commit'\] but not "):
        trainer(base_model, CommitsOnly())
    with pytest.raises(TypeError, match=r"SavesOnly .*CheckpointedBatchSource"):
        trainer(base_model, SavesOnly())


async def test_the_console_line_is_a_hook_every_log_every_steps(base_model, caplog) -> None:
    seen: list[tuple[float, int]] = []
    tr = trainer(
        base_model,
        CommittingSource(),
        cfg=cfg(log_every=2),
        hooks=TrainerHooks(on_log=lambda stats, v: seen.append((stats["step"], v))),
    )
    await tr.train(num_steps=4)
    assert seen == [(2.0, 0), (4.0, 0)]  # steps 2 and 4; no publisher: version 0

    with caplog.at_level(logging.INFO, logger="libludic.training.trainer"):
        await trainer(base_model, CommittingSource(), cfg=cfg()).train(num_steps=1)
    assert [r.getMessage()[:7] for r in caplog.records if "samples/s" in r.getMessage()] == [
        "step 1 "
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="libludic.training.trainer"):
        src = CommittingSource()
        await trainer(base_model, src, cfg=cfg(), hooks=TrainerHooks(on_log=None)).train(1)
    assert src.n == 1 and not [r for r in caplog.records if "samples/s" in r.getMessage()]
