"""Rollouts -> SAWItems (token alignment), collate padding/truncation, micro-batch packing."""

from __future__ import annotations

import pytest
import torch
from jaxtyping import TypeCheckError

from libludic.models.tiny import IM_END_ID, PAD_ID, encode_bytes
from libludic.training.collate import collate, pack_micro_batches, rollouts_to_saw_items
from tests.fakes import make_item, make_rollout


def test_items_are_token_in_token_out() -> None:
    prompt = [257] + encode_bytes("user\n12+34=") + [IM_END_ID]
    completion = encode_bytes("46") + [IM_END_ID]
    r = make_rollout(
        "r1",
        [1.0],
        group_id="g",
        prompt=prompt,
        completion=completion,
        logprobs=[-0.1, -0.2, -0.3],
        policy_version=7,
        info={"finish_reason": "stop", "parse_error": None},
    )
    (it,) = rollouts_to_saw_items([r], {("r1", 0): 0.25})
    assert it.input_ids == prompt + completion
    assert it.action_mask == [0] * len(prompt) + [1, 1, 1]
    assert it.attention_mask == [1] * (len(prompt) + 3)
    assert it.attachments.actor_logprobs == [0.0] * len(prompt) + [-0.1, -0.2, -0.3]
    assert it.attachments.policy_version == 7
    assert it.weight == 0.25
    assert it.meta == {
        "item_id": "r1:0",
        "rollout_id": "r1",
        "step_index": 0,
        "group_id": "g",
        "reward": 1.0,
        "step_reward": 1.0,
        "truncated": False,
        "terminated": True,
        "finish_reason": "stop",
        "parse_error": None,
    }


def test_multi_step_rollout_gives_item_per_step_with_total_reward() -> None:
    r = make_rollout("r", [0.5, 1.5])
    items = rollouts_to_saw_items([r], {("r", 0): 1.0, ("r", 1): 2.0})
    assert [i.item_id for i in items] == ["r:0", "r:1"]
    assert [i.meta["reward"] for i in items] == [2.0, 2.0]
    assert [i.meta["step_reward"] for i in items] == [0.5, 1.5]
    assert items[0].attachments.actor_logprobs is None  # trace had no logprobs


def test_step_without_trace_names_rollout_and_fix() -> None:
    r = make_rollout("r9", [1.0], trace=False)
    with pytest.raises(
        ValueError, match=r"Rollout r9 step 0 has no TokenTrace.*ReturnSpec.for_rl\(\)"
    ):
        rollouts_to_saw_items([r], {("r9", 0): 1.0})


def test_missing_weight_raises() -> None:
    with pytest.raises(KeyError, match="no credit weight"):
        rollouts_to_saw_items([make_rollout("r", [1.0])], {})


def test_collate_pads_right_and_aligns() -> None:
    a, b = make_item(3, 2, weight=1.5, seed=1), make_item(2, 1, weight=-1.0, seed=2)
    out = collate([a, b], pad_token_id=PAD_ID)
    assert out["input_ids"].shape == (2, 5)
    assert out["input_ids"][1].tolist() == b.input_ids + [PAD_ID, PAD_ID]
    assert out["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert out["action_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    torch.testing.assert_close(out["weight"], torch.tensor([1.5, -1.0]))
    torch.testing.assert_close(
        out["actor_logprobs"][1], torch.tensor(b.attachments.actor_logprobs + [0.0, 0.0])
    )
    assert "ref_logprobs" not in out


def test_collate_truncates_state_from_left() -> None:
    it = make_item(6, 2, seed=3)
    out = collate([it], pad_token_id=0, max_seq_len=5)
    # 8 tokens -> drop the 3 oldest state tokens, keep both action tokens
    assert out["input_ids"][0].tolist() == it.input_ids[3:]
    assert out["action_mask"][0].tolist() == [0, 0, 0, 1, 1]
    assert out["actor_logprobs"][0].tolist() == pytest.approx(it.attachments.actor_logprobs[3:])


def test_collate_rejects_when_actions_do_not_fit() -> None:
    it = make_item(2, 4, seed=4)
    # 4 action tokens + 1 predicting state token = 5 > 4
    with pytest.raises(ValueError, match=r"cannot fit max_seq_len=4"):
        collate([it], pad_token_id=0, max_seq_len=4)
    assert collate([it], pad_token_id=0, max_seq_len=5)["input_ids"].shape == (1, 5)


def test_collate_typecheck(monkeypatch) -> None:
    monkeypatch.setenv("LUDIC_TYPECHECK", "1")
    out = collate([make_item(2, 2), make_item(3, 1, seed=5)], pad_token_id=0)
    assert out["input_ids"].dtype == torch.long
    from libludic.training.typecheck import check_batch

    out["actor_logprobs"] = out["actor_logprobs"][:, :-1]
    with pytest.raises(TypeCheckError):
        check_batch(out)


def test_pack_respects_padded_budget() -> None:
    lens = [10, 3, 7, 7, 2, 9]
    items = [make_item(L - 1, 1, seed=i) for i, L in enumerate(lens)]
    mbs = pack_micro_batches(items, micro_token_budget=20)
    for mb in mbs:
        B, T = len(mb), max(it.num_tokens for it in mb)
        assert B * T <= 20
    assert sorted(it.item_id for mb in mbs for it in mb) == sorted(it.item_id for it in items)
    # longest first: [10, 9] (2*10 = 20), [7, 7] (adding 3 -> 3*7 = 21 > 20), [3, 2]
    assert [[it.num_tokens for it in mb] for mb in mbs] == [[10, 9], [7, 7], [3, 2]]


def test_pack_oversized_item_goes_alone() -> None:
    items = [make_item(29, 1, seed=0), make_item(3, 1, seed=1), make_item(3, 1, seed=2)]
    mbs = pack_micro_batches(items, micro_token_budget=10)
    assert [[it.num_tokens for it in mb] for mb in mbs] == [[30], [4, 4]]


def test_pack_counts_truncated_length() -> None:
    items = [make_item(29, 1, seed=0), make_item(3, 1, seed=1)]
    # truncated to 8 tokens: 2 * 8 = 16 <= 16 -> one micro-batch
    assert len(pack_micro_batches(items, micro_token_budget=16, max_seq_len=8)) == 1
