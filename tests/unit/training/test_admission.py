"""Admission (libludic/training/admission.py): the one judge of which items a step trains.

A source that forms batches itself gets the Trainer's Admission and the Trainer judges its
items no more; any other source's stale items are dropped by the Trainer at the version
every rank agrees on (the acknowledged one, not rank 0's served one). SourceIdle from a
source runs ``hooks.on_idle`` and the step then trains the batch that follows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from libludic.saw import SAWBatch
from libludic.training.admission import Admission, AdmittingBatchSource
from libludic.training.config import TrainerConfig
from libludic.training.presets import make_sft
from libludic.training.trainer import Trainer, TrainerHooks
from libludic.training.types import SourceIdle
from tests.fakes import ListBatchSource, make_item


@dataclass
class Versions:
    version: int = 0
    served_version: int = 0


def test_staleness_is_judged_at_the_served_or_the_acknowledged_version() -> None:
    adm = Admission(max_lag=1, versions=Versions(version=2, served_version=3))
    items = [make_item(2, 1, policy_version=v) for v in (0, 1, 2, None)]
    fresh, stale = adm.split_stale(items, lambda it: it)
    assert [it.policy_version for it in fresh] == [2, None]
    assert [it.policy_version for it in stale] == [0, 1]
    fresh, stale = adm.split_stale(items, lambda it: it, served=False)
    assert [it.policy_version for it in fresh] == [1, 2, None]
    assert Admission().split_stale(items, lambda it: it) == (items, [])  # max_lag None: off
    assert Admission().problem(items[0]) is None
    with pytest.raises(ValueError, match="max_lag"):
        Admission(max_lag=-1)


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


class AdmittingSource:
    """Hands out one batch holding an item of version 0; raises SourceIdle ``idle`` times
    first."""

    def __init__(self, idle: int = 0) -> None:
        self.admission = Admission()
        self.idle = idle

    async def next_batch(self) -> SAWBatch:
        if self.idle:
            self.idle -= 1
            raise SourceIdle()
        return SAWBatch(items=[make_item(4, 2, seed=1, policy_version=0)])


async def test_an_admitting_source_gets_the_trainers_admission_and_is_not_judged_again(
    base_model,
) -> None:
    src = AdmittingSource(idle=2)
    assert isinstance(src, AdmittingBatchSource)
    idles: list[int] = []

    async def on_idle() -> None:
        idles.append(1)

    tr = Trainer(
        model=base_model,
        algo=make_sft(),
        batch_source=src,
        cfg=TrainerConfig(max_lag=0, micro_token_budget=64, model_device="cpu"),
        hooks=TrainerHooks(on_idle=on_idle, on_log=None),
    )
    assert src.admission is tr.admission
    tr.publishing.version = 5  # the item (v0) would be stale to the Trainer's own judge
    stats = await tr.train_step()
    assert len(idles) == 2  # each SourceIdle ran the hook, then the batch came
    assert stats["num_items"] == 1 and stats["stale_dropped"] == 0


async def test_any_other_sources_items_are_judged_by_the_trainer(base_model) -> None:
    items = [make_item(4, 2, seed=s, policy_version=v) for s, v in ((1, 0), (2, 4))]
    tr = Trainer(
        model=base_model,
        algo=make_sft(),
        batch_source=ListBatchSource([items]),
        cfg=TrainerConfig(max_lag=1, micro_token_budget=64, model_device="cpu"),
        hooks=TrainerHooks(on_log=None),
    )
    tr.publishing.version, tr.publishing.served_version = 5, 9  # judged at 5, not rank 0's 9
    stats = await tr.train_step()
    assert stats["num_items"] == 1 and stats["stale_dropped"] == 1
