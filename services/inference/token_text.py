"""Completion text decoded once per choice instead of token by token.

vLLM detokenizes every sampled token as it is generated: an incremental detokenizer for the
text and, when logprobs are asked, one more decode per token for the logprob entry's
``token`` string (with up to four extra decodes when a byte-fallback token leaves an
incomplete UTF-8 sequence). That runs in the API server process, on the cores generation
shares, for every token of every choice. A rollout reads neither: the actor takes the token
ids and the chosen-token logprobs, and the text once, at the end.

So a request that can do without it runs with ``SamplingParams.detokenize=False`` and the
app decodes each choice's token ids once when it finishes (``fill_text``). A request takes
this path only when nothing vLLM does depends on the text as it is generated
(``decodes_once``): it asked for ``return_token_ids`` and ``return_tokens_as_token_ids``
(its logprob entries, top ones included, name tokens ``token_id:<id>``: no token string is
needed), it is not
streamed, has no stop strings, no tools, no echo, no prompt logprobs, and the server runs no
tool or reasoning parser. Every other request is served exactly as vLLM serves it.

The text comes from vLLM's own detokenizer, run once over the finished ids (``fill_text``);
``tests/integration/test_inference.py`` checks it equals the text of the same seeded
request served the usual way.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def decodes_once(req: Any, endpoint: str, handler: Any) -> bool:
    """Whether the request ``req`` (vLLM's ChatCompletionRequest or CompletionRequest) can
    run without per-token detokenization (see the module docstring)."""
    if not (getattr(req, "return_token_ids", False) and req.return_tokens_as_token_ids):
        return False
    if req.stream or req.stop or getattr(req, "echo", False):
        return False
    if getattr(req, "prompt_logprobs", None) is not None:
        return False
    if endpoint == "chat":
        return not req.tools and getattr(handler, "parser_cls", None) is None
    return not getattr(req, "suffix", None)


def fill_text(data: dict[str, Any], endpoint: str, tokenizer: Any, req: Any) -> None:
    """Write each choice's text into the response body ``data``: its ``token_ids`` run
    through vLLM's own incremental detokenizer in one go, primed with the prompt's ids as
    vLLM primes it, so spacing after the prompt, special tokens and an incomplete UTF-8
    sequence at the end come out exactly as vLLM would have written them."""
    # vLLM where used: the response model's tests import this module without it
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
    )
    for choice in data.get("choices") or []:
        ids = choice.get("token_ids")
        prompt = choice.get("prompt_token_ids") or data.get("prompt_token_ids")
        if ids is None or prompt is None:
            continue
        request = SimpleNamespace(
            request_id="", sampling_params=params, prompt_token_ids=list(prompt), prompt_embeds=None
        )
        detok = IncrementalDetokenizer.from_new_request(tokenizer, request)  # type: ignore[arg-type]
        # as vLLM: a stop token (finish_reason "stop": EOS or a stop token id, there being
        # no stop strings on this path) is not part of the text
        detok.update(list(ids), choice.get("finish_reason") == "stop")
        text = detok.get_next_output_text(finished=True, delta=False)
        if endpoint == "chat":
            message = choice.get("message")
            if message is not None:
                message["content"] = text
        else:
            choice["text"] = text
