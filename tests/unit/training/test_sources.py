"""Batch sources (rollout, offline JSONL) and the evaluator, with a fake rollout engine."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from libludic.eval.evaluator import Evaluator
from libludic.inference.request import ReturnSpec
from libludic.models.tiny import IM_END_ID, encode_bytes
from libludic.requests import EnvSpec, RolloutRequest
from libludic.training.batching.offline import OfflineBatchSource
from libludic.training.batching.rollout_batch_source import RolloutBatchSource
from libludic.training.filters import drop_parse_errors
from libludic.training.presets import make_grpo, make_reinforce, make_sft
from libludic.training.types import BatchSource
from tests.fakes import FakeEngine, make_rollout


def requests(n_groups=2, group_size=2):
    return [
        RolloutRequest(
            env=EnvSpec("arithmetic"),
            env_seed=i,
            num_episodes=group_size,
            same_env_seed=True,
            meta={"group_id": f"g{i}"},
        )
        for i in range(n_groups)
    ]


async def test_rollout_batch_source_runs_engine_and_credits() -> None:
    eng = FakeEngine([[1.0, 0.0, 1.0, 1.0]])
    src = RolloutBatchSource(
        engine=eng,
        request_fn=requests,
        algorithm=make_grpo(group_size=2),
        max_steps=3,
        concurrency=5,
    )
    assert isinstance(src, BatchSource)
    batch = await src.next_batch()
    assert eng.calls[0]["max_steps"] == 3 and eng.calls[0]["concurrency"] == 5
    # g0 rewards (1, 0) -> +-0.5; g1 (1, 1) -> 0, 0
    assert [i.weight for i in batch.items] == [0.5, -0.5, 0.0, 0.0]
    assert batch.meta["reward_mean"] == pytest.approx(0.75)
    assert batch.items[0].attachments.actor_logprobs[-2:] == [-0.5, -0.7]


async def test_rollout_batch_source_retries_empty_batches() -> None:
    from libludic.training.presets import make_scalerl

    eng = FakeEngine([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # first call all zero-variance
    src = RolloutBatchSource(engine=eng, request_fn=requests, algorithm=make_scalerl(group_size=2))
    batch = await src.next_batch()
    assert len(eng.calls) == 2 and [i.meta["group_id"] for i in batch.items] == ["g0", "g0"]
    src2 = RolloutBatchSource(
        engine=FakeEngine([[1.0]]),
        request_fn=requests,
        algorithm=make_scalerl(group_size=2),
        max_empty_batches=2,
    )
    with pytest.raises(RuntimeError, match="filtered to nothing"):
        await src2.next_batch()


async def test_offline_rollout_jsonl(tmp_path) -> None:
    rs = [make_rollout(f"r{i}", [float(i)], logprobs=[-0.1, -0.2]) for i in range(5)]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(json.dumps(r.to_dict()) for r in rs) + "\n")
    src = OfflineBatchSource(path, batch_size=2, algorithm=make_reinforce(), shuffle=False)
    b1, b2, b3 = [await src.next_batch() for _ in range(3)]
    assert [i.item_id for i in b1.items] == ["r0:0", "r1:0"]
    assert [i.weight for i in b2.items] == [2.0, 3.0]  # Monte Carlo return = reward
    # third batch wraps into epoch 1
    assert [i.item_id for i in b3.items] == ["r4:0", "r0:0"] and src.epoch == 1


async def test_offline_chat_samples_use_chat_template(tmp_path, tiny_model_dir) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    recs = [
        {
            "messages": [
                {"role": "user", "content": "12+34="},
                {"role": "assistant", "content": "46"},
            ]
        }
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(recs[0]) + "\n")
    src = OfflineBatchSource(path, batch_size=1, tokenizer=tok, algorithm=make_sft())
    (it,) = (await src.next_batch()).items
    enc = tok.apply_chat_template(
        [recs[0]["messages"][0]], add_generation_prompt=True, tokenize=True
    )
    prompt = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    q = encode_bytes("12+34=")
    assert prompt[0] == 257 and any(prompt[i : i + len(q)] == q for i in range(len(prompt)))
    assert it.input_ids == prompt + encode_bytes("46") + [IM_END_ID]
    assert it.action_mask == [0] * len(prompt) + [1, 1, 1]
    assert it.weight == 1.0


async def test_offline_position_resumes(tmp_path) -> None:
    rs = [make_rollout(f"r{i}", [0.0]) for i in range(7)]
    recs = [r.to_dict() for r in rs]
    a = OfflineBatchSource(recs, batch_size=3, seed=5)
    for _ in range(3):
        await a.next_batch()
    b = OfflineBatchSource(recs, batch_size=3, seed=5)
    b.load_state_dict(a.state_dict())
    assert [i.item_id for i in (await a.next_batch()).items] == [
        i.item_id for i in (await b.next_batch()).items
    ]


def test_offline_rejects_bad_records(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither a rollout"):
        OfflineBatchSource([{"text": "hi"}], batch_size=1)
    with pytest.raises(ValueError, match="must end with an assistant message"):
        src = OfflineBatchSource(
            [{"messages": [{"role": "user", "content": "x"}]}], batch_size=1, tokenizer=object()
        )
        src._items_of(0)


async def test_offline_filter(tmp_path) -> None:
    rs = [make_rollout("ok", [1.0]), make_rollout("bad", [0.0], info={"parse_error": "x"})]
    src = OfflineBatchSource(
        [r.to_dict() for r in rs],
        batch_size=2,
        shuffle=False,
        algorithm=make_reinforce(),
        sample_filter=drop_parse_errors(),
    )
    assert {i.item_id for i in (await src.next_batch()).items} == {"ok:0"}


async def test_evaluator_reports_mean_and_pass_rate() -> None:
    eng = FakeEngine([[1.0, 0.0, 0.5, 1.0]])
    ev = Evaluator(engine=eng, requests=lambda: requests(n_groups=4, group_size=1), concurrency=7)
    res = await ev.evaluate()
    # rewards (1, 0, 0.5, 1): mean 0.625, pass (>= 1) 2 of 4
    assert res == {
        "eval/reward_mean": pytest.approx(0.625),
        "eval/pass_rate": 0.5,
        "eval/num_episodes": 4.0,
    }
    sent = eng.calls[0]["requests"]
    assert all(r.inference.return_spec == ReturnSpec.for_eval() for r in sent)
    assert eng.calls[0]["concurrency"] == 7
