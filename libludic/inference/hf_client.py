"""In-process ChatClient on a transformers causal LM: a real backend for laptops and tests.

Concurrent ``complete()`` calls are gathered into one batched generation (left-padded,
KV-cached), at most ``max_batch_size`` rows, run in a worker thread so the event loop
stays free. Semantics match the vLLM server:

* completion token ids include the EOS token that ended the reply; text excludes it;
* ``completion_logprobs`` are the chosen tokens' logprobs under the distribution actually
  sampled (``ludic inference``'s vLLM ``processed_logprobs``): ``log_softmax(logits / T)``,
  renormalised over the top-k tokens (``top_k``), then over the top-p nucleus of those
  (``top_p`` < 1), vLLM's order; at T = 0 (greedy) untempered;
* a stop string ends generation; the text is cut before it, the ids keep its tokens;
* a token of ``stop_token_ids`` ends generation and is kept in the ids, like EOS;
* ``seed`` seeds a per-row generator, so a request is reproducible alone or in a batch;
* ``policy_version`` starts at 0 and becomes the version given to ``sync_weights``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from libludic.inference.request import ChatCompletionRequest
from libludic.types import ChatResponse


@dataclass
class _Pending:
    request: ChatCompletionRequest
    future: asyncio.Future[ChatResponse]
    prompt_ids: list[int] = field(default_factory=list)


class HFChatClient:
    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        device: str = "cpu",
        max_batch_size: int = 32,
        policy_version: int = 0,
    ) -> None:
        # transformers takes seconds to import: only a client that loads a model pays it
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if model is None or tokenizer is None:
            if model_dir is None:
                raise ValueError("HFChatClient needs model_dir, or both model and tokenizer")
            if not Path(model_dir).exists():
                raise FileNotFoundError(
                    f"model dir {model_dir} does not exist; build one with `ludic model init DIR`"
                )
        self.tokenizer: Any = (
            tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(model_dir))
        )
        self.model: Any = (
            model if model is not None else AutoModelForCausalLM.from_pretrained(str(model_dir))
        )
        self.model.to(device).eval()  # type: ignore[arg-type]
        self.device = device
        self.max_batch_size = max_batch_size
        self.policy_version = policy_version
        eos = (
            getattr(self.model.generation_config, "eos_token_id", None)
            or self.tokenizer.eos_token_id
        )
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._queue: list[_Pending] = []
        self._worker: asyncio.Task[None] | None = None
        self._weights_lock = threading.Lock()

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]:
        loop = asyncio.get_running_loop()
        p = _Pending(request, loop.create_future(), self.prompt_ids(list(request.messages)))  # type: ignore[arg-type]
        self._queue.append(p)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await p.future, {"backend": "hf"}

    async def _drain(self) -> None:
        while self._queue:
            await asyncio.sleep(0)  # let concurrent callers enqueue before a batch forms
            batch, self._queue = (
                self._queue[: self.max_batch_size],
                self._queue[self.max_batch_size :],
            )
            try:
                outs = await asyncio.to_thread(self._generate, batch)
            except Exception as e:  # every waiter hears about the failure
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p, o in zip(batch, outs):
                if not p.future.done():
                    p.future.set_result(o)

    async def get_policy_version(self) -> int:
        return self.policy_version

    def sync_weights(
        self, params: Mapping[str, Any], timeout_s: float = 600.0, version: int | None = None
    ) -> str:
        with self._weights_lock:
            missing = [k for k in params if k not in self.model.state_dict()]
            if missing:
                raise KeyError(f"unknown parameter names {missing[:5]}")
            self.model.load_state_dict(dict(params), strict=False)
            self.policy_version = self.policy_version + 1 if version is None else int(version)
        return f"policy_version={self.policy_version}"

    @torch.no_grad()
    def _generate(self, batch: list[_Pending]) -> list[ChatResponse]:
        with self._weights_lock:
            version = self.policy_version
            return self._generate_locked(batch, version)

    def _generate_locked(self, batch: list[_Pending], version: int) -> list[ChatResponse]:
        B = len(batch)
        lens = [len(p.prompt_ids) for p in batch]
        T = max(lens)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, T - lens[i] :] = torch.tensor(p.prompt_ids)
            mask[i, T - lens[i] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = []
        for p in batch:
            g = torch.Generator(device="cpu")
            g.manual_seed(p.request.seed if p.request.seed is not None else torch.seed() % 2**63)
            gens.append(g)
        max_new = [p.request.sampling.max_tokens for p in batch]
        stops = []
        for p in batch:
            s = p.request.sampling.stop
            stops.append([] if s is None else [s] if isinstance(s, str) else list(s))
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        cut_text: list[str | None] = [None] * B
        stop_tok = [False] * B  # ended by EOS or a stop token id
        past = None
        step_ids, step_pos = ids, pos
        temps = torch.tensor([p.request.sampling.temperature for p in batch], dtype=torch.float32)
        greedy = temps == 0
        nucleus = [
            (p.request.sampling.top_p < 1.0 or p.request.sampling.top_k is not None)
            and not greedy[i]
            for i, p in enumerate(batch)
        ]
        for _t in range(max(max_new)):
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[:, -1, :].float().cpu()  # [B, V]
            for i, p in enumerate(batch):  # min_tokens: no ending token before it (vLLM's mask)
                if finish[i] is None and len(out_ids[i]) < p.request.sampling.min_tokens:
                    ending = [*self.eos_ids, *(p.request.sampling.stop_token_ids or ())]
                    logits[i, ending] = float("-inf")
            # log_softmax(logits / T) per row (T = 1 for greedy rows: untempered logprobs)
            logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
            # Gumbel-max with each row's own generator: a sample of softmax(logits / T),
            # reproducible per request alone or in a batch
            live = [i for i in range(B) if finish[i] is None]
            gumbel = torch.zeros_like(logp)
            for i in live:
                if not greedy[i] and not nucleus[i]:
                    u = torch.rand(logp.shape[1], generator=gens[i]).clamp_(1e-20, 1.0)
                    gumbel[i] = -torch.log(-torch.log(u))
            picked = torch.argmax(logp + gumbel, dim=-1)  # greedy rows: argmax of the logits
            nxt = torch.full((B,), self.pad_id, dtype=torch.long)
            for i in live:
                p = batch[i]
                sp = p.request.sampling
                if nucleus[i]:  # top-k, then top-p: sample from the renormalised rest
                    probs = logp[i].exp()
                    sp_sorted, idx = torch.sort(probs, descending=True)
                    if sp.top_k is not None:
                        sp_sorted, idx = sp_sorted[: sp.top_k], idx[: sp.top_k]
                        sp_sorted = sp_sorted / sp_sorted.sum()
                    keep = sp_sorted.cumsum(-1) - sp_sorted < sp.top_p
                    probs = torch.zeros_like(probs).scatter(0, idx[keep], sp_sorted[keep])
                    probs = probs / probs.sum()
                    tok = int(torch.multinomial(probs, 1, generator=gens[i]))
                    lp = float(torch.log(probs[tok]))
                else:
                    tok = int(picked[i])
                    lp = float(logp[i, tok])
                nxt[i] = tok
                out_ids[i].append(tok)
                out_lp[i].append(lp)
                if tok in self.eos_ids and not sp.ignore_eos:
                    finish[i], stop_tok[i] = "stop", True
                elif sp.stop_token_ids and tok in sp.stop_token_ids:
                    finish[i], stop_tok[i] = "stop", True
                elif stops[i]:
                    text = str(
                        self.tokenizer.decode(
                            out_ids[i], skip_special_tokens=sp.skip_special_tokens
                        )
                    )
                    hit = [text.find(s) for s in stops[i] if s in text]
                    if hit:
                        finish[i], cut_text[i] = "stop", text[: min(hit)]
                if finish[i] is None and len(out_ids[i]) >= max_new[i]:
                    finish[i] = "length"
            if all(f is not None for f in finish):
                break
            step_ids = nxt.view(B, 1).to(self.device)
            mask = torch.cat(
                [mask, torch.ones((B, 1), dtype=mask.dtype, device=self.device)], dim=1
            )
            step_pos = step_pos[:, -1:] + 1
        results = []
        for i, p in enumerate(batch):
            cut = cut_text[i]
            # as vLLM: the stop token that ended the completion is not part of its text
            text_ids = out_ids[i][:-1] if stop_tok[i] else out_ids[i]
            skip = p.request.sampling.skip_special_tokens
            text = (
                cut
                if cut is not None
                else str(self.tokenizer.decode(text_ids, skip_special_tokens=skip))
            )
            rs = p.request.return_spec
            results.append(
                ChatResponse(
                    text=text,
                    finish_reason=finish[i] or "length",
                    prompt_token_ids=list(p.prompt_ids) if rs.return_token_ids else None,
                    completion_token_ids=list(out_ids[i]) if rs.return_token_ids else None,
                    completion_logprobs=list(out_lp[i]) if rs.return_chosen_logprobs else None,
                    policy_version=version,
                    temperature=float(p.request.sampling.temperature),
                )
            )
        return results
