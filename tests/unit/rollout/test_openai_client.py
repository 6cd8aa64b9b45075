"""OpenAIChatClient against a fake OpenAI-compatible replica (tests/fakes.py) on a free port."""

import pytest

from libludic.inference.client import InferenceError
from libludic.inference.openai_client import OpenAIChatClient
from libludic.inference.request import ChatCompletionRequest, ReturnSpec
from tests.conftest import free_port
from tests.fakes import Choice, FakeOpenAIServer


@pytest.fixture(scope="module")
def server():
    # a reply cut at max_tokens; responses say version 4, /v1/policy_version 7 (read apart)
    hi = Choice("hi", token_ids=(104, 105), logprobs=(-0.25, -1.5), finish_reason="length")
    with FakeOpenAIServer(hi, version=4, endpoint_version=7, health=False) as s:
        yield s


@pytest.fixture(autouse=True)
def _reset(server):
    server.fail_next, server.mode = [], "ok"


def req() -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "1"}], seed=9)


async def test_parses_token_ids_logprobs_version_and_sends_rl_fields(server):
    c = OpenAIChatClient(server.url)
    resp, info = await c.complete(req())
    assert resp.text == "hi" and resp.finish_reason == "length"
    assert resp.prompt_token_ids == [257, 49] and resp.completion_token_ids == [104, 105]
    assert resp.completion_logprobs == [-0.25, -1.5] and resp.policy_version == 4
    body = server.bodies[-1]
    assert body["model"] == "tiny" and body["seed"] == 9
    assert body["return_token_ids"] is True and body["logprobs"] is True
    assert "top_logprobs" not in body  # ReturnSpec.for_rl asks for no alternatives
    assert body["return_tokens_as_token_ids"] is True  # the server decodes the text once
    assert body["temperature"] == 0.7 and body["max_tokens"] == 256
    assert await c.get_policy_version() == 7 and await c.health() is False  # no /health on the fake
    await c.aclose()


async def test_model_list_is_fetched_once_by_concurrent_callers(server):
    import asyncio

    n0 = server.model_gets
    c = OpenAIChatClient(server.url)
    await asyncio.gather(*(c.complete(req()) for _ in range(20)))
    assert server.model_gets - n0 == 1
    await c.aclose()


async def test_retries_5xx_then_succeeds(server):
    server.fail_next = [503, 500]
    c = OpenAIChatClient(server.url, max_retries=3, backoff_s=0.01)
    resp, _ = await c.complete(req())
    assert resp.text == "hi" and len(server.bodies) >= 3
    await c.aclose()


async def test_gives_up_after_bounded_retries(server):
    server.fail_next = [503] * 10
    n0 = len(server.bodies)
    c = OpenAIChatClient(server.url, max_retries=2, backoff_s=0.01)
    with pytest.raises(InferenceError, match="after 3 attempts.*HTTP 503"):
        await c.complete(req())
    assert len(server.bodies) - n0 == 3
    await c.aclose()


async def test_4xx_fails_at_once_with_server_message(server):
    server.fail_next = [400]
    n0 = len(server.bodies)
    c = OpenAIChatClient(server.url, backoff_s=0.01)
    with pytest.raises(InferenceError, match="HTTP 400.*boom"):
        await c.complete(req())
    assert len(server.bodies) - n0 == 1
    await c.aclose()


async def test_malformed_json_is_a_clear_error(server):
    server.mode = "malformed"
    c = OpenAIChatClient(server.url)
    with pytest.raises(InferenceError, match="malformed JSON"):
        await c.complete(req())
    await c.aclose()


async def test_missing_token_ids_is_an_error_when_asked(server):
    server.mode = "no_ids"
    c = OpenAIChatClient(server.url)
    with pytest.raises(InferenceError, match="did not return token ids"):
        await c.complete(req())
    r = ChatCompletionRequest(messages=[{"role": "user", "content": "1"}], return_spec=ReturnSpec())
    resp, _ = await c.complete(r)
    assert resp.text == "hi" and resp.completion_token_ids is None
    await c.aclose()


async def test_server_down_is_a_clear_error():
    c = OpenAIChatClient(
        f"http://127.0.0.1:{free_port()}", max_retries=1, backoff_s=0.01, model="m"
    )
    with pytest.raises(InferenceError, match="is the server up"):
        await c.complete(req())
    await c.aclose()


def seeded(seed: int | None, content: str = "1") -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": content}], seed=seed)


async def test_a_group_sent_together_is_one_request_with_n_choices(server):
    """8 episodes of one GRPO group (same prompt, seeds 20..27) -> one POST, n=8, seed=20;
    episode i gets choice i, whose seed on the server is 20 + i (vLLM's rule)."""
    import asyncio

    c = OpenAIChatClient(server.url, model="m")
    before = len(server.bodies)
    got = await asyncio.gather(*[c.complete(seeded(20 + i)) for i in reversed(range(8))])
    sent = server.bodies[before:]
    assert len(sent) == 1 and sent[0]["n"] == 8 and sent[0]["seed"] == 20
    # gather returns in call order: calls were made for seeds 27, 26, ..., 20
    assert [r.completion_token_ids for r, _ in got] == [[127 - i] for i in range(8)]
    assert [r.completion_logprobs for r, _ in got] == [[-0.5 - (7 - i)] for i in range(8)]
    assert all(r.policy_version == 4 and r.prompt_token_ids == [257, 49] for r, _ in got)
    await c.aclose()


async def test_only_identical_requests_with_consecutive_seeds_share_a_request(server):
    import asyncio

    c = OpenAIChatClient(server.url, model="m", max_coalesce=3)
    before = len(server.bodies)
    calls = [seeded(s) for s in (1, 2, 3, 4, 7)] + [seeded(5, "other"), seeded(None), seeded(None)]
    got = await asyncio.gather(*[c.complete(r) for r in calls])
    sent = sorted(
        (
            (b["messages"][0]["content"], b.get("seed"), b.get("n", 1))
            for b in server.bodies[before:]
        ),
        key=str,
    )
    # seeds 1-3 (cut at max_coalesce), 4 alone, 7 alone (not consecutive), the other prompt
    # alone, the two unseeded calls together
    assert sent == sorted(
        [("1", 1, 3), ("1", 4, 1), ("1", 7, 1), ("other", 5, 1), ("1", None, 2)], key=str
    )
    assert [r.completion_token_ids for r, _ in got[:3]] == [[101], [102], [103]]
    await c.aclose()


async def test_coalescing_off_sends_one_request_per_call(server):
    import asyncio

    c = OpenAIChatClient(server.url, model="m", coalesce=False)
    before = len(server.bodies)
    await asyncio.gather(*[c.complete(seeded(i)) for i in range(4)])
    assert [b.get("n", 1) for b in server.bodies[before:]] == [1, 1, 1, 1]
    await c.aclose()


async def test_a_failed_shared_request_fails_every_caller(server):
    import asyncio

    c = OpenAIChatClient(server.url, model="m", max_retries=0)
    server.fail_next = [400]
    got = await asyncio.gather(*[c.complete(seeded(i)) for i in range(3)], return_exceptions=True)
    assert all(isinstance(e, InferenceError) and "HTTP 400" in str(e) for e in got)
    await c.aclose()


async def test_greedy_calls_are_never_coalesced(server):
    import asyncio

    from libludic.inference.sampling import SamplingConfig

    c = OpenAIChatClient(server.url, model="m")
    before = len(server.bodies)
    greedy = ChatCompletionRequest(
        messages=[{"role": "user", "content": "1"}], sampling=SamplingConfig(temperature=0.0)
    )
    await asyncio.gather(*[c.complete(greedy) for _ in range(3)])
    assert [b.get("n", 1) for b in server.bodies[before:]] == [1, 1, 1]
    await c.aclose()
