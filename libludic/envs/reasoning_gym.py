"""ReasoningGymEnv: one-step problems from reasoning-gym's procedural datasets.

reasoning-gym (the optional extra ``reasoning-gym``) generates each of its datasets locally
from a config and a seed and scores an answer with the dataset's own ``score_answer``; this
env is the ``reasoning_gym`` kind. ``dataset`` names one of its datasets (``chain_sum``,
``basic_arithmetic``, ...), ``config`` that dataset's config fields, ``size`` and
``dataset_seed`` which problems it holds (entry ``i`` of the dataset is its problem ``i``).

Episode: ``reset(seed)`` shows problem ``seed % n`` of the split's ``n`` problems (None: a
random one) through ``prompt_template`` (``{question}`` is replaced by the question, every
other character kept); ``step(answer)`` ends the episode with

    reward = dataset.score_answer(answer, entry)     # 1.0: solved; some datasets give
                                                     # partial credit in (0, 1)

``answer`` is what the protocol's parser extracted from the reply. ``info["reference"]`` is
the entry's answer (None where the dataset checks a reply without one, e.g. ``boxnet``).

Held-out split: a problem is an *eval* problem when a hash of its question text falls in
the first tenth of the hash range. ``split="train"`` keeps the dataset's other problems,
``split="eval"`` only those, ``split=None`` all of them. A split by question text holds
whatever the two envs' ``size`` or ``dataset_seed``: many datasets draw entry ``i`` from
``Random(seed + i)``, so two dataset seeds a few apart share almost every problem, and a
small problem space (one-digit sums) repeats the same question at many indices, which a
split by seed or by index would put on both sides. ``distinct=True`` keeps each question
once (its first entry): an evaluation over distinct problems rather than over entries as
the dataset samples them (where a repeated easy question weighs as often as it repeats).
The dataset and its entries are cached per process (:func:`dataset_source`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS

from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.envs.splits import EVAL_BUCKETS, SPLITS, in_eval_split
from libludic.types import Info, Obs, StepOutcome


@dataclass
class DatasetSource:
    """One built dataset, its entries generated on demand and the indices of each split."""

    name: str
    dataset: Any  # a reasoning_gym ProceduralDataset
    size: int
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    splits: dict[str, list[int]] = field(default_factory=dict)

    def entry(self, index: int) -> dict[str, Any]:
        if index not in self.entries:
            self.entries[index] = self.dataset[index]
        return self.entries[index]

    def split(self, name: str | None, distinct: bool = False) -> list[int]:
        """The indices of ``name``'s problems (None: every entry), in dataset order;
        ``distinct``: each question once, at its first entry (a small problem space
        repeats questions among ``size`` entries: one-digit products are 100 problems, a
        quarter of the entries). The first call of a split generates all ``size`` entries
        (most datasets take well under 1 ms an entry; a few take tens of milliseconds, like
        ``countdown``, or more, like ``futoshiki`` at ~0.4 s)."""
        key = f"{name}{'/distinct' if distinct else ''}"
        if key not in self.splits:
            held, seen, out = name == "eval", set(), []
            for i in range(self.size):
                q = str(self.entry(i)["question"])
                if (name is None or in_eval_split(q) == held) and not (distinct and q in seen):
                    out.append(i)
                    seen.add(q)
            self.splits[key] = out
        return self.splits[key]


_SOURCES: dict[str, DatasetSource] = {}  # (dataset, config, size, seed) -> its source


def config_fields(dataset: str) -> list[str]:
    return [f.name for f in dataclasses.fields(DATASETS[dataset][1])]


def build_dataset(dataset: str, config: Mapping[str, Any], size: int, seed: int) -> Any:
    """``reasoning_gym.create_dataset``, its errors naming the value and the choices."""
    if dataset not in DATASETS:
        near = difflib.get_close_matches(dataset, list(DATASETS), n=3)
        hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
        raise ValueError(
            f"reasoning_gym dataset={dataset!r} is not a reasoning-gym dataset{hint}; the "
            f"{len(DATASETS)} datasets: {', '.join(sorted(DATASETS))}"
        )
    fields = [f for f in config_fields(dataset) if f not in ("size", "seed")]
    owned = sorted(set(config) & {"size", "seed"})
    if owned:
        raise ValueError(
            f"reasoning_gym dataset {dataset!r}: config sets {owned}; give the env's size= "
            "and dataset_seed= instead"
        )
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(
            f"reasoning_gym dataset {dataset!r}: unknown config field(s) {unknown}; its "
            f"fields: {fields}"
        )
    try:
        return reasoning_gym.create_dataset(dataset, **config, size=size, seed=seed)
    except (AssertionError, TypeError, ValueError) as e:  # the config's own validate()
        raise ValueError(
            f"reasoning_gym dataset {dataset!r} rejected config {dict(config)}: "
            f"{type(e).__name__}: {e}"
        ) from e


def dataset_source(dataset: str, config: Mapping[str, Any], size: int, seed: int) -> DatasetSource:
    """The cached source of ``dataset`` with ``config``, ``size`` entries and ``seed``.

    The dataset and its generated entries are cached per process: an env is built for every
    episode, so the first env of a split generates all ``size`` entries once per process."""
    key = json.dumps([dataset, dict(config), size, seed], sort_keys=True, default=repr)
    if key not in _SOURCES:
        _SOURCES[key] = DatasetSource(dataset, build_dataset(dataset, config, size, seed), size)
    return _SOURCES[key]


class ReasoningGymEnv(SingleAgentEnv):
    """One-step episodes over a reasoning-gym dataset (see the module docstring)."""

    def __init__(
        self,
        dataset: str,
        config: Mapping[str, Any] | None = None,
        size: int = 500,
        dataset_seed: int = 0,
        split: str | None = None,
        prompt_template: str = "{question}",
        system_prompt: str | None = None,
        distinct: bool = False,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"reasoning_gym split={split!r} must be null, 'train' or 'eval'")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"reasoning_gym size={size!r} must be an integer >= 1")
        if "{question}" not in prompt_template:
            raise ValueError(
                f"reasoning_gym prompt_template={prompt_template!r} must contain '{{question}}'"
            )
        if config is not None and not isinstance(config, Mapping):
            raise ValueError(f"reasoning_gym config={config!r} must be a mapping of its fields")
        if not isinstance(distinct, bool):
            raise ValueError(f"reasoning_gym distinct={distinct!r} must be true or false")
        self.source = dataset_source(dataset, config or {}, size, dataset_seed)
        self.indices: list[int] | None = None
        if split is not None or distinct:
            self.indices = self.source.split(split, distinct=distinct)
            if not self.indices:
                raise ValueError(
                    f"reasoning_gym dataset {dataset!r} holds no {split} problems among its "
                    f"{size} entries (a question is held out when its hash falls in 1 of "
                    f"{EVAL_BUCKETS} buckets); raise size or set split: null"
                )
        self.split = split
        self.prompt_template = prompt_template
        self._system_prompt = system_prompt
        self._index: int | None = None
        self._by_reference: dict[str, int] = {}  # answer -> index of an entry reset with it

    @property
    def suggested_system_prompt(self) -> str | None:
        return self._system_prompt

    def __len__(self) -> int:
        """The split's problems."""
        return self.source.size if self.indices is None else len(self.indices)

    @property
    def entry(self) -> dict[str, Any]:
        if self._index is None:
            raise RuntimeError("ReasoningGymEnv has no problem before env_reset")
        return self.source.entry(self._index)

    @property
    def reference(self) -> str | None:
        answer = self.entry["answer"]
        return None if answer is None else str(answer)

    def env_reset(self, *, seed: int | None = None) -> tuple[Obs, Info]:
        s = random.randrange(2**31) if seed is None else seed
        k = s % len(self)
        self._index = k if self.indices is None else self.indices[k]
        if self.reference is not None:
            self._by_reference[self.reference] = self._index
        return self.env_current_obs(), {
            "seed": s,
            "index": self._index,
            "reference": self.reference,
        }

    def env_step(self, action: str) -> StepOutcome:
        if self._index is None:
            raise RuntimeError("ReasoningGymEnv.env_step called before env_reset")
        score = float(self.source.dataset.score_answer(action, self.entry))
        ref = self.reference
        return StepOutcome(
            obs="correct" if score == 1.0 else f"scored {score:g}; the answer was {ref}",
            reward=score,
            terminated=True,
            info={
                "reference": ref,
                "correct": score == 1.0,
                "index": self._index,
                "dataset": self.source.name,
            },
        )

    def env_current_obs(self) -> Obs:
        return self.prompt_template.replace("{question}", str(self.entry["question"]))

    # ReferenceEnv (libludic/envs/reference.py): supervised data and checks from this env

    def reference_completion(self) -> str:
        ref = self.reference
        if ref is None:
            raise ValueError(
                f"reasoning_gym dataset {self.source.name!r} states no answer for entry "
                f"{self._index} (its score_answer checks a reply against the problem), so it "
                "gives no supervised data"
            )
        return ref

    def score_completion(self, completion: str, reference: str) -> float:
        """The dataset's score of ``completion`` against the last entry this env was reset
        to whose answer is ``reference`` (a score that reads only the answer, as most do,
        is exact; one that reads the entry's metadata scores against that entry)."""
        index = self._by_reference.get(reference)
        entry: dict[str, Any] = (
            {"question": "", "answer": reference, "metadata": {}}
            if index is None
            else self.source.entry(index)
        )
        return float(self.source.dataset.score_answer(completion, entry))
