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
        messages=[{"role": "user", "content": "12+34="}], sampling=SamplingConfig(**{"temperature": 1.0, "max_tokens": 12, **kw}), seed=seed
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
    torch.testing.assert_close(torch.tensor(r.completion_logprobs), torch.tensor(ref), atol=1e-4, rtol=0)
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
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], sampling=SamplingConfig(max_tokens=2), return_spec=ReturnSpec.for_eval())
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
