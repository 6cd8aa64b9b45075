"""HFChatClient on the real tiny model: ids, logprobs, seeds, stops, weight sync."""

import asyncio

import pytest
import torch

from libludic.inference.hf_client import HFChatClient
from libludic.inference.request import ChatCompletionRequest, ReturnSpec
from libludic.inference.sampling import SamplingConfig


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    return HFChatClient(tiny_model_dir)


def req(seed=1, **kw):
    return ChatCompletionRequest(
        messages=[{"role": "user", "content": "12+34="}],
        sampling=SamplingConfig(**{"temperature": 1.0, "max_tokens": 12, **kw}),
        seed=seed,
    )


@pytest.mark.parametrize("temp", [1.0, 0.6])
async def test_logprobs_are_those_of_the_sampled_distribution(client, temp):
    """log_softmax(logits / T)[token], as ludic inference (vLLM processed_logprobs) returns."""
    r, _ = await client.complete(req(temperature=temp))
    assert r.temperature == temp and r.trace().temperature == temp
    ids = torch.tensor([r.prompt_token_ids + r.completion_token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(client.model(ids).logits.float() / temp, -1)[0]
    n = len(r.prompt_token_ids)
    # logits at position n-1+j predict completion token j
    ref = [float(lp[n - 1 + j, t]) for j, t in enumerate(r.completion_token_ids)]
    torch.testing.assert_close(
        torch.tensor(r.completion_logprobs), torch.tensor(ref), atol=1e-4, rtol=0
    )
    assert r.prompt_token_ids == client.prompt_ids([{"role": "user", "content": "12+34="}])
    assert r.policy_version == 0


async def test_seeded_sampling_is_reproducible_alone_and_batched(client):
    alone, _ = await client.complete(req(seed=5))
    batch = await asyncio.gather(*(client.complete(req(seed=s)) for s in (4, 5, 6)))
    assert batch[1][0].completion_token_ids == alone.completion_token_ids


async def test_finish_reasons_and_return_spec(client):
    r, _ = await client.complete(req(max_tokens=3, temperature=0.0))
    assert r.finish_reason in ("length", "stop") and len(r.completion_token_ids) <= 3
    r2, _ = await client.complete(
        ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}],
            sampling=SamplingConfig(max_tokens=2),
            return_spec=ReturnSpec.for_eval(),
        )
    )
    assert r2.completion_token_ids is not None and r2.completion_logprobs is None


async def test_sync_weights_changes_output_and_version(tiny_model_dir):
    c = HFChatClient(tiny_model_dir)
    before, _ = await c.complete(req(temperature=0.0))
    sd = {k: torch.randn_like(v) for k, v in c.model.state_dict().items()}
    assert c.sync_weights(sd, version=3) == "policy_version=3"
    after, _ = await c.complete(req(temperature=0.0))
    assert after.policy_version == 3 and after.completion_token_ids != before.completion_token_ids
    with pytest.raises(KeyError, match="unknown parameter"):
        c.sync_weights({"nope": torch.zeros(1)})


def test_missing_model_dir_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="ludic model init"):
        HFChatClient(tmp_path / "none")


@pytest.mark.parametrize("kw", [{"top_k": 3}, {"top_k": 5, "top_p": 0.5}])
async def test_top_k_samples_among_the_k_likeliest_and_reports_their_renormalised_logprob(
    client, kw
):
    """vLLM's order: top-k, renormalise, then top-p over what is left; the logprob is the
    sampled token's under that final renormalised distribution."""
    r, _ = await client.complete(req(seed=7, temperature=1.0, max_tokens=6, **kw))
    ids = torch.tensor([r.prompt_token_ids + r.completion_token_ids])
    with torch.no_grad():
        probs = torch.softmax(client.model(ids).logits.float(), -1)[0]
    n = len(r.prompt_token_ids)
    for j, (t, lp) in enumerate(zip(r.completion_token_ids, r.completion_logprobs)):
        top, idx = torch.sort(probs[n - 1 + j], descending=True)
        top, idx = top[: kw["top_k"]], idx[: kw["top_k"]]
        top = top / top.sum()
        keep = top.cumsum(-1) - top < kw.get("top_p", 1.0)
        assert t in idx[keep].tolist()  # sampled inside the kept set
        kept = top[keep] / top[keep].sum()
        want = float(torch.log(kept[idx[keep].tolist().index(t)]))
        assert lp == pytest.approx(want, abs=1e-4)


async def test_a_stop_token_id_ends_generation_and_is_kept(client):
    free, _ = await client.complete(req(seed=3, temperature=1.0, max_tokens=12))
    assert len(free.completion_token_ids) >= 3, "this seed must give a few tokens to stop at"
    stop = free.completion_token_ids[2]
    first = free.completion_token_ids.index(stop)
    r, _ = await client.complete(req(seed=3, temperature=1.0, max_tokens=12, stop_token_ids=[stop]))
    assert r.completion_token_ids == free.completion_token_ids[: first + 1]
    assert r.finish_reason == "stop"


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": 2.5}, "top_k=2.5"),
        ({"stop_token_ids": [-1]}, "stop_token_ids="),
    ],
)
def test_bad_top_k_and_stop_token_ids_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kw)


def test_top_k_and_stop_token_ids_go_into_the_openai_body():
    body = SamplingConfig(top_k=20, stop_token_ids=[7, 9]).to_openai()
    assert body["top_k"] == 20 and body["stop_token_ids"] == [7, 9]
    assert "top_k" not in SamplingConfig().to_openai()
    assert SamplingConfig.from_dict(
        SamplingConfig(stop_token_ids=[7]).to_dict()
    ).stop_token_ids == (7,)


async def test_special_tokens_in_the_text_only_when_asked_and_never_the_stop_token(client):
    """Past an ignored EOS the tiny model writes special tokens: skip_special_tokens=False
    keeps their strings in the text (as vLLM does); the stop token id that ends a
    completion is in its ids but not in its text, in both modes (as vLLM)."""
    tok = client.tokenizer
    special = set(tok.all_special_ids)
    seed = None
    for s in range(200):  # a seed whose completion has a special token before its last one
        r, _ = await client.complete(req(seed=s, max_tokens=24, ignore_eos=True))
        if special & set(r.completion_token_ids[:-1]):
            seed = s
            break
    assert seed is not None
    kept, _ = await client.complete(
        req(seed=seed, max_tokens=24, ignore_eos=True, skip_special_tokens=False)
    )
    plain, _ = await client.complete(req(seed=seed, max_tokens=24, ignore_eos=True))
    assert kept.completion_token_ids == plain.completion_token_ids
    assert kept.text == tok.decode(kept.completion_token_ids, skip_special_tokens=False)
    assert plain.text == tok.decode(plain.completion_token_ids, skip_special_tokens=True)
    assert kept.text != plain.text
    stop = plain.completion_token_ids[3]
    for skip in (True, False):
        r, _ = await client.complete(
            req(
                seed=seed,
                max_tokens=24,
                ignore_eos=True,
                stop_token_ids=[stop],
                skip_special_tokens=skip,
            )
        )
        assert r.finish_reason == "stop" and r.completion_token_ids[-1] == stop
        assert r.text == tok.decode(r.completion_token_ids[:-1], skip_special_tokens=skip)
    assert SamplingConfig(skip_special_tokens=False).to_openai()["skip_special_tokens"] is False
    assert "skip_special_tokens" not in SamplingConfig().to_openai()


async def test_min_tokens_masks_the_ending_tokens_before_it(client):
    free, _ = await client.complete(req(seed=3, temperature=1.0, max_tokens=12))
    stop = free.completion_token_ids[2]
    first = free.completion_token_ids.index(stop)
    n = first + 3
    r, _ = await client.complete(
        req(seed=3, temperature=1.0, max_tokens=12, stop_token_ids=[stop], min_tokens=n)
    )
    assert len(r.completion_token_ids) >= n  # neither the stop token nor EOS ended it sooner
    assert stop not in r.completion_token_ids[:n]
    assert not set(client.eos_ids) & set(r.completion_token_ids[:n])
    # the logprob of a token sampled under the mask is of the masked distribution
    ids = torch.tensor([r.prompt_token_ids + r.completion_token_ids])
    with torch.no_grad():
        logits = client.model(ids).logits.float()[0]
    p = len(r.prompt_token_ids)
    row = logits[p - 1 + first].clone()
    row[[*client.eos_ids, stop]] = float("-inf")
    want = float(torch.log_softmax(row, -1)[r.completion_token_ids[first]])
    assert r.completion_logprobs[first] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("bad", [-1, 13, True])
def test_min_tokens_is_checked_and_goes_into_the_openai_body(bad):
    with pytest.raises(ValueError, match="min_tokens="):
        SamplingConfig(max_tokens=12, min_tokens=bad)
    assert SamplingConfig(min_tokens=4).to_openai()["min_tokens"] == 4
    assert "min_tokens" not in SamplingConfig().to_openai()
