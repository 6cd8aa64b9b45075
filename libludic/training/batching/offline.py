"""OfflineBatchSource: SFT / offline RL from a local JSONL file (or in-memory records).

Each line is one of:

* a rollout, as written by ``Rollout.to_dict()`` (``{"id", "steps", "meta"}``); its steps
  must carry TokenTraces. All rollout lines get credit together at load time from
  ``algorithm.credit_assigner`` (so grouped assigners see whole groups).
* a chat sample ``{"messages": [..., {"role": "assistant", "content": ...}]}``: the state is
  the tokenizer's chat template over every message but the last (with the generation
  prompt), the action is the last message's content followed by the tokenizer's EOS
  (``<|im_end|>`` for Qwen-style templates) tokenised without special-token insertion.
  Chat samples are independent one-step rollouts (optional ``"reward"``, ``"group_id"``)
  tokenised lazily and cached, and credited one by one.
* a pair ``{"prompt": ..., "completion": ...}``: the chat sample with one user message (the
  prompt) and the completion as the assistant's answer.

Batches: ``batch_size`` items per call; epochs are reshuffled with ``seed + epoch`` when
``shuffle``; the position (epoch, offset) is ``state_dict()`` for exact resumption.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from libludic.saw import SAWBatch, SAWItem
from libludic.training.algorithm import RLAlgorithm
from libludic.training.filters import SampleFilter
from libludic.training.presets import make_sft
from libludic.types import Rollout, Step, TokenTrace


def _ids(enc: Any) -> list[int]:
    if isinstance(enc, Mapping) or hasattr(enc, "keys"):
        enc = enc["input_ids"]
    return [int(t) for t in enc]


def pair_to_chat(record: Mapping[str, Any]) -> dict[str, Any]:
    """A ``{"prompt", "completion"}`` pair as the chat sample it stands for (one user
    message, one assistant message); its other keys (``reward``, ``group_id``) are kept."""
    rest = {k: v for k, v in record.items() if k not in ("prompt", "completion")}
    messages = [
        {"role": "user", "content": str(record["prompt"])},
        {"role": "assistant", "content": str(record["completion"])},
    ]
    return {**rest, "messages": messages}


def chat_sample_to_rollout(record: Mapping[str, Any], tokenizer: Any, rollout_id: str) -> Rollout:
    msgs = list(record["messages"])
    if len(msgs) < 2 or msgs[-1].get("role") != "assistant":
        raise ValueError(
            f"chat sample {rollout_id} must end with an assistant message (the target) after "
            'at least one prompt message, e.g. {"messages": [{"role": "user", ...}, '
            '{"role": "assistant", ...}]}'
        )
    if tokenizer is None:
        raise ValueError(
            f"chat sample {rollout_id} needs a tokenizer: OfflineBatchSource(tokenizer=...)"
        )
    prompt = _ids(
        tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True)
    )
    target = str(msgs[-1]["content"])
    eos = getattr(tokenizer, "eos_token", None)
    if eos and not target.endswith(eos):
        target += eos
    completion = _ids(tokenizer(target, add_special_tokens=False))
    step = Step(
        index=0,
        prev_obs=str(msgs[-2].get("content", "")),
        action=str(msgs[-1]["content"]),
        next_obs=None,
        reward=float(record.get("reward", 0.0)),
        terminated=True,
        trace=TokenTrace(prompt_token_ids=prompt, completion_token_ids=completion),
    )
    meta = {"group_id": record.get("group_id")} if record.get("group_id") is not None else {}
    return Rollout(id=rollout_id, steps=[step], meta=meta)


class OfflineBatchSource:
    def __init__(
        self,
        records: str | Path | Sequence[Mapping[str, Any]],
        *,
        batch_size: int,
        tokenizer: Any = None,
        algorithm: RLAlgorithm | None = None,
        shuffle: bool = True,
        seed: int = 0,
        sample_filter: SampleFilter | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"OfflineBatchSource.batch_size={batch_size} must be >= 1")
        self.batch_size = batch_size
        self.tokenizer = tokenizer
        self.algorithm = algorithm if algorithm is not None else make_sft()
        self.shuffle = shuffle
        self.seed = seed
        self.sample_filter = sample_filter
        name = "mem"
        if isinstance(records, (str, Path)):
            name = Path(records).stem
            records = self._read_jsonl(Path(records))
        # entries: a precomputed list of SAWItems (rollout line) or a raw chat record
        self._entries: list[Any] = []
        rollouts: list[Rollout] = []
        for i, rec in enumerate(records):
            if "steps" in rec:
                rollouts.append(Rollout.from_dict(rec))
                self._entries.append(("rollout", rollouts[-1].id))
            elif "messages" in rec:
                self._entries.append(("chat", f"{name}:{i}", rec))
            elif "prompt" in rec and "completion" in rec:
                self._entries.append(("chat", f"{name}:{i}", pair_to_chat(rec)))
            else:
                raise ValueError(
                    f"record {i} of {name} is neither a rollout (Rollout.to_dict()) nor a chat "
                    f'sample ({{"messages": [...]}}) nor a pair ({{"prompt": ..., '
                    f'"completion": ...}}); keys: {sorted(rec)}'
                )
        if not self._entries:
            raise ValueError(f"OfflineBatchSource got no records from {name}")
        self._rollout_items: dict[str, list[SAWItem]] = {}
        if rollouts:
            for it in self.algorithm.to_saw_items(rollouts, None):
                self._rollout_items.setdefault(str(it.meta["rollout_id"]), []).append(it)
        self._chat_cache: dict[str, list[SAWItem]] = {}
        self.epoch = 0
        self.pos = 0
        self._order = self._make_order()

    @staticmethod
    def _read_jsonl(path: Path) -> list[dict[str, Any]]:
        out = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not valid JSON ({e})") from e
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def _make_order(self) -> list[int]:
        order = list(range(len(self._entries)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def _items_of(self, idx: int) -> list[SAWItem]:
        e = self._entries[idx]
        if e[0] == "rollout":
            items = self._rollout_items.get(e[1], [])
        else:
            key = json.dumps(e[2]["messages"], sort_keys=True)
            cached = self._chat_cache.get(key)
            if cached is None:
                r = chat_sample_to_rollout(e[2], self.tokenizer, e[1])
                cached = self.algorithm.to_saw_items([r], None)
                self._chat_cache[key] = cached
            items = cached
        if self.sample_filter is not None:
            items = [it for it in items if self.sample_filter(it)]
        return items

    async def next_batch(self) -> SAWBatch:
        items: list[SAWItem] = []
        visited = 0
        while len(items) < self.batch_size:
            if self.pos >= len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._make_order()
            items.extend(self._items_of(self._order[self.pos]))
            self.pos += 1
            visited += 1
            if visited > 2 * len(self._entries) and not items:
                raise ValueError("every record was filtered out; check sample_filter")
        return SAWBatch(items=items, meta={"epoch": self.epoch, "pos": self.pos})

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
        self._order = self._make_order()
