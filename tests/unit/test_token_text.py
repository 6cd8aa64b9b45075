"""Which requests the inference server serves without per-token detokenization, and the
text it then writes (services/inference/token_text.py). The equality with vLLM's own text
on a real server is tests/integration/test_inference.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from services.inference.token_text import decodes_once, fill_text

ROLLOUT = {"return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": True}


def chat(**kw: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "1+2="}], **ROLLOUT, **kw}
    )


def completion(**kw: Any) -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    body = {"model": "m", "prompt": "1+2=", **ROLLOUT, "logprobs": 0, **kw}
    return CompletionRequest.model_validate(body)


NO_PARSER = SimpleNamespace(parser_cls=None)


def test_the_rollout_request_decodes_once() -> None:
    assert decodes_once(chat(), "chat", NO_PARSER)
    assert decodes_once(chat(top_logprobs=3), "chat", NO_PARSER)  # top entries named by id
    assert decodes_once(completion(), "completions", None)


@pytest.mark.parametrize(
    "change",
    [
        {"return_tokens_as_token_ids": False},  # logprob entries want token strings
        {"return_token_ids": False},  # nothing to decode the text from
        {"stream": True},
        {"stop": ["\n"]},  # stop strings are matched on the text as it is generated
        {"echo": True},
        {"prompt_logprobs": 1},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    ],
)
def test_requests_that_need_the_text_as_it_is_generated_do_not(change: dict[str, Any]) -> None:
    assert not decodes_once(chat(**change), "chat", NO_PARSER)


def test_a_server_with_a_tool_or_reasoning_parser_decodes_token_by_token() -> None:
    assert not decodes_once(chat(), "chat", SimpleNamespace(parser_cls=object))


@pytest.mark.parametrize("change", [{"echo": True}, {"suffix": "x"}, {"stop": "x"}])
def test_completions_that_need_the_text_do_not(change: dict[str, Any]) -> None:
    assert not decodes_once(completion(**change), "completions", None)


def test_fill_text_primes_with_the_prompt_and_drops_a_stop_token(tmp_path: Any) -> None:
    from transformers import AutoTokenizer

    from libludic.models.tiny import encode_bytes, init_model

    tok = AutoTokenizer.from_pretrained(str(init_model(tmp_path / "m", size="tiny")))
    eos = int(tok.eos_token_id)
    body = {
        "prompt_token_ids": encode_bytes("1+2="),
        "choices": [
            # ended by EOS: the stop token is not text
            {
                "message": {"content": ""},
                "token_ids": [*encode_bytes("3"), eos],
                "finish_reason": "stop",
            },
            # "é" split over two byte tokens, the second missing: held back, as vLLM does
            {
                "message": {"content": ""},
                "token_ids": [*encode_bytes("ok"), 0xC3],
                "finish_reason": "length",
            },
        ],
    }
    fill_text(body, "chat", tok, chat())
    assert [c["message"]["content"] for c in body["choices"]] == ["3", "ok"]
    done = {"prompt_token_ids": body["prompt_token_ids"], "choices": [
        {"text": "", "token_ids": [*encode_bytes("ok"), 0xC3, 0xA9], "finish_reason": "length"}
    ]}  # fmt: skip
    fill_text(done, "completions", tok, completion())
    assert done["choices"][0]["text"] == "oké"
