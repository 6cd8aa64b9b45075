"""LLMJudge: a chat model grades each rollout (the ``llm_judge`` reward kind).

The judge is asked ``template`` filled with the rollout (``{prompt}``, ``{completion}``,
``{answer}``, and ``{reference}``: the last step's ``info[reference_key]``, empty when the
env gives none) at temperature 0 and scores its reply:

    score = yes_score   if the reply's first word is "yes"
          = no_score    if it is "no"
          = x / scale   if it starts with a number x (a 0-10 grade: scale 10)
          = unparsed_score otherwise (None: a RewardError, the request dead-lettered)

It talks to any OpenAI-compatible endpoint: ``url`` (another server; its bearer token read
from the environment variable ``api_key_env``, never from the config), or, with no ``url``,
the run's own inference service (the client the actor samples from). Transport failures
are retried by the client (the project's Backoff policy, ``retries`` times); a call longer
than ``timeout_s`` or still failing raises RewardError.
"""

from __future__ import annotations

import asyncio
import os
import re

from libludic.inference.client import ChatClient, InferenceError
from libludic.inference.openai_client import OpenAIChatClient
from libludic.inference.request import ChatCompletionRequest, ReturnSpec
from libludic.inference.sampling import SamplingConfig
from libludic.scoring.base import RewardError, RewardInput

DEFAULT_TEMPLATE = (
    "Grade the answer to the task below.\n\nTask:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Reference answer (may be empty):\n{reference}\n\n"
    "Is the answer correct? Reply with yes or no."
)
_FIRST_WORD = re.compile(r"\s*[\W_]*([A-Za-z]+|-?\d+(?:\.\d+)?)")


class LLMJudge:
    def __init__(
        self,
        client: ChatClient | None = None,
        url: str | None = None,
        model: str | None = None,
        template: str = DEFAULT_TEMPLATE,
        reference_key: str = "reference",
        max_tokens: int = 8,
        timeout_s: float = 60.0,
        retries: int = 2,
        api_key_env: str | None = None,
        yes_score: float = 1.0,
        no_score: float = 0.0,
        scale: float = 10.0,
        unparsed_score: float | None = 0.0,
    ) -> None:
        if "{completion}" not in template:
            raise ValueError(f"llm_judge template must contain {{completion}}; got {template!r}")
        try:
            template.format(prompt="", completion="", answer="", reference="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"llm_judge template {template!r}: {e!r}; its fields are {{prompt}}, "
                "{completion}, {answer}, {reference} (write {{ and }} for braces)"
            ) from None
        if timeout_s <= 0 or scale <= 0 or retries < 0 or max_tokens < 1:
            raise ValueError(
                "llm_judge needs timeout_s > 0, scale > 0, retries >= 0 and max_tokens >= 1"
            )
        if url:
            key = os.environ.get(api_key_env) if api_key_env else None
            if api_key_env and not key:
                raise ValueError(f"llm_judge api_key_env={api_key_env!r} is not set")
            client = OpenAIChatClient(
                url, api_key=key, model=model, timeout_s=timeout_s, max_retries=retries
            )
        elif client is None:
            raise ValueError("llm_judge needs url=<OpenAI-compatible base URL> or the run's client")
        self.client: ChatClient = client
        self.model, self.template, self.reference_key = model, template, reference_key
        self.sampling = SamplingConfig(temperature=0.0, max_tokens=max_tokens)
        self.timeout_s = timeout_s
        self.yes, self.no, self.scale, self.unparsed = yes_score, no_score, scale, unparsed_score

    def verdict(self, reply: str) -> float:
        """The score of the judge's ``reply`` (module docstring)."""
        m = _FIRST_WORD.match(reply)
        word = m.group(1).lower() if m else ""
        if word == "yes":
            return self.yes
        if word == "no":
            return self.no
        try:
            return float(word) / self.scale
        except ValueError:
            pass
        if self.unparsed is None:
            raise RewardError(f"llm_judge: cannot read a verdict from the judge's reply {reply!r}")
        return self.unparsed

    async def __call__(self, sample: RewardInput) -> float:
        ref = sample.info.get(self.reference_key, "")
        text = self.template.format(
            prompt=sample.prompt,
            completion=sample.completion,
            answer="" if sample.answer is None else sample.answer,
            reference="" if ref is None else str(ref),
        )
        request = ChatCompletionRequest(
            messages=[{"role": "user", "content": text}],
            sampling=self.sampling,
            return_spec=ReturnSpec(),
            model=self.model,
        )
        try:
            response, _ = await asyncio.wait_for(self.client.complete(request), self.timeout_s)
        except (TimeoutError, InferenceError) as e:
            raise RewardError(
                f"llm_judge: the judge did not answer: {type(e).__name__}: {e}"
            ) from e
        return self.verdict(response.text)

    def __repr__(self) -> str:
        return f"LLMJudge(model={self.model!r})"
