"""The spare-core training thread: it shares a step's micro-batches, never makes a step wait
for it, and leaves the gradient what it is without it."""

from __future__ import annotations

import copy
import os
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.training.algorithm import RLAlgorithm
from libludic.training.config import TrainerConfig
from libludic.training.credit_assignment import ConstantCredit
from libludic.training.loss import ReinforceLoss
from libludic.training.spare_core import SpareCoreHelper
from libludic.training.trainer import Trainer
from tests.fakes import ListBatchSource, make_item

CORES = tuple(sorted(os.sched_getaffinity(0)))


@pytest.fixture
def helper():
    h = SpareCoreHelper(CORES)
    yield h
    h.close()


def test_the_helper_takes_micro_batches_and_its_gradients_come_back_summed(helper) -> None:
    """The training thread's first micro-batch waits until the helper has finished one, so
    both take work; the helper's gradients (i+1 for micro-batch i) come back as one sum."""
    helper_done = threading.Event()
    on_main: list[int] = []

    def main_fn(i: int) -> str:
        if not on_main:
            assert helper_done.wait(30), "the helper never took a micro-batch"
        on_main.append(i)
        return f"main{i}"

    def helper_fn(i: int):
        out = (f"helper{i}", [torch.full((2,), float(i + 1)), None])
        helper_done.set()
        return out

    results, grads = helper.run(6, main_fn, helper_fn)
    by_helper = [i for i in range(6) if results[i] == f"helper{i}"]
    assert by_helper and sorted(by_helper + on_main) == list(range(6))
    assert all(results[i] == f"main{i}" for i in on_main)
    assert grads is not None and grads[1] is None
    torch.testing.assert_close(grads[0], torch.full((2,), float(sum(i + 1 for i in by_helper))))
    assert helper.micro_batches_total == len(by_helper)


def test_a_starved_helper_never_makes_the_step_wait(helper) -> None:
    """The helper gets stuck in its micro-batch (as one starved of CPU would): the training
    thread takes it back, the step completes without it, and the helper's late result is
    thrown away, not added to the next step."""
    release = threading.Event()
    helper_in = threading.Event()

    def main_fn(i: int) -> str:
        if i == 0:
            assert helper_in.wait(30)
        return f"main{i}"

    def stuck(i: int):
        helper_in.set()
        release.wait(30)
        return "late", [torch.ones(1)]

    results, grads = helper.run(3, main_fn, stuck)
    assert results == ["main0", "main1", "main2"]
    assert grads is None and helper.taken_back_total == 1
    release.set()
    results, grads = helper.run(2, lambda i: f"next{i}", lambda i: (f"h{i}", [torch.zeros(1)]))
    assert grads is None or float(grads[0].sum()) == 0.0  # nothing of the stuck one
    assert helper.micro_batches_total <= 2


def test_a_micro_batch_raising_in_the_helper_is_computed_by_the_training_thread(helper) -> None:
    def boom(i: int):
        raise RuntimeError("bad batch")

    def main_fn(i: int) -> int:
        deadline = time.monotonic() + 30
        while i == 0 and not helper.broken and time.monotonic() < deadline:
            time.sleep(0.01)  # let the helper take one micro-batch and raise
        return i * 10

    results, grads = helper.run(4, main_fn, boom)
    assert results == [0, 10, 20, 30] and grads is None
    assert "bad batch" in helper.broken


def test_a_step_that_raises_leaves_the_helper_nothing_of_it(helper) -> None:
    """A micro-batch raising on the training thread (a poison item) ends the step: the helper
    takes no more of it, and the next step runs as usual."""
    started = threading.Event()

    def main_fn(i: int) -> int:
        raise ValueError("poison")

    def helper_fn(i: int):
        started.set()
        return i, [torch.ones(1)]

    with pytest.raises(ValueError, match="poison"):
        helper.run(50, main_fn, helper_fn)
    taken = helper.micro_batches_total
    time.sleep(0.2)
    assert helper.micro_batches_total <= taken + 1  # at most the one it was on
    results, _ = helper.run(3, lambda i: i, helper_fn)
    assert results == [0, 1, 2]


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def trainer(model, algo: RLAlgorithm | None = None, **kw) -> Trainer:
    cfg = TrainerConfig(
        model_device="cpu", mixed_precision_dtype=None, pad_token_id=PAD_ID, lr=1e-2, **kw
    )
    algo = algo if algo is not None else RLAlgorithm("t", ConstantCredit(), ReinforceLoss())
    return Trainer(model=copy.deepcopy(model), algo=algo, cfg=cfg, batch_source=ListBatchSource([]))


def test_the_gradient_with_the_helper_is_the_gradient_without_it(base_model) -> None:
    shapes = [(5, 3, 1.0), (9, 6, -0.5), (3, 2, 2.0), (12, 4, 0.3), (4, 7, -1.2), (6, 1, 0.7)]
    items = [make_item(s, a, weight=w, seed=i) for i, (s, a, w) in enumerate(shapes * 4)]
    plain = trainer(base_model)
    spare = trainer(base_model, spare_cores=CORES, spare_core_micro_batches=6)
    assert plain.spare is None and spare.spare is not None
    plain.model.train()
    spare.model.train()
    a = plain.accumulate_gradients(items)
    b = spare.accumulate_gradients(items)
    assert a["num_micro_batches"] == 1 and b["num_micro_batches"] >= 6
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for (n, p), q in zip(plain.model.named_parameters(), spare.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_with_a_critic_the_helper_brings_back_its_gradients_too(base_model) -> None:
    from libludic.training.presets import make_ppo

    shapes = [(5, 3, 1.0), (9, 6, -0.5), (3, 2, 2.0), (12, 4, 0.3), (4, 7, -1.2), (6, 1, 0.7)]
    items = [make_item(s, a, weight=w, seed=i) for i, (s, a, w) in enumerate(shapes * 2)]
    plain = trainer(base_model, make_ppo())
    spare = trainer(base_model, make_ppo(), spare_cores=CORES, spare_core_micro_batches=6)
    assert spare.spare is not None and plain.critic is not None and spare.critic is not None
    for t in (plain, spare):  # a critic whose head passes gradient to its backbone
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            t.critic.model.value_head.weight.normal_(0.0, 0.1, generator=g)
    a = plain.accumulate_gradients(items)
    b = spare.accumulate_gradients(items)
    assert b["num_micro_batches"] >= 6 and b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for x, y in ((plain.model, spare.model), (plain.critic.model, spare.critic.model)):
        for (n, p), q in zip(x.named_parameters(), y.parameters(), strict=True):
            assert p.grad is not None, n
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_the_helper_is_not_used_with_gradient_checkpointing(base_model, caplog) -> None:
    caplog.set_level("INFO", logger="libludic.training.spare_core")
    t = trainer(base_model, spare_cores=CORES, gradient_checkpointing=True)
    assert t.spare is None and "gradient checkpointing is on" in caplog.text


def test_split_largest_cuts_the_costliest_micro_batch_until_there_are_enough() -> None:
    from libludic.training.minibatch import split_largest

    long_ = [make_item(20, 4, seed=i) for i in range(4)]
    short = [make_item(2, 2, seed=10 + i) for i in range(4)]
    out = split_largest([long_, short], 4)
    # costs 96 and 16 -> the long one in halves (48, 48, 16) -> the first half again
    assert [len(m) for m in out] == [1, 1, 2, 4]
    assert sorted(it.item_id for m in out for it in m) == sorted(it.item_id for it in long_ + short)
    assert split_largest([[long_[0]]], 3) == [[long_[0]]]  # one item cannot be cut
