"""DatasetQAEnv: one-step question answering over rows of a dataset.

Rows are ``{question_key: str, answer_key: str}`` mappings from a local JSON (a list of
objects), JSONL or CSV file, an in-memory list, or a Hugging Face ``datasets`` dataset
(``from_hf``; ``datasets`` is an optional dependency imported only there).

Episode: ``reset(seed)`` shows row ``seed % len(rows)`` (None: a random row) formatted by
``prompt_template``; ``step(answer)`` ends the episode with
reward = 1.0 if ``verifier(answer, reference)`` else 0.0.

The reference is ``answer_extractor(row[answer_key])`` when an extractor is given (e.g.
``gsm8k_extract_answer`` keeps the text after ``####``), else the raw answer. Verifiers are
``(prediction, reference) -> bool``:

- ``exact_match_verifier`` (default): equal after ``normalise_answer`` (case-folded,
  whitespace collapsed, surrounding quotes/spaces and a trailing period dropped);
- ``numeric_verifier``: the last number in the prediction equals the last number in the
  reference as decimals (``1,000`` == ``1000`` == ``1000.0``; ``$42`` -> 42).
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.types import Info, Obs, StepOutcome

Verifier = Callable[[str, str], bool]
AnswerExtractor = Callable[[str], str]

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def normalise_answer(text: str) -> str:
    s = " ".join(str(text).split()).casefold()
    s = s.strip(" \"'`")
    return s[:-1].rstrip() if s.endswith(".") else s


def exact_match_verifier(prediction: str, reference: str) -> bool:
    return normalise_answer(prediction) == normalise_answer(reference)


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (thousands commas allowed), or None."""
    for m in reversed(_NUMBER_RE.findall(str(text))):
        try:
            return Decimal(m.replace(",", ""))
        except InvalidOperation:
            continue
    return None


def numeric_verifier(prediction: str, reference: str) -> bool:
    want = last_number(reference)
    if want is None:
        raise ValueError(
            f"numeric_verifier: reference {reference!r} holds no number; use "
            f"exact_match_verifier for non-numeric answers"
        )
    got = last_number(prediction)
    return got is not None and got == want


def gsm8k_extract_answer(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last ``####``, commas
    dropped (``"...so 1,200 #### 1,200"`` -> ``"1200"``)."""
    if "####" not in answer:
        raise ValueError(
            f"GSM8K answer has no '####' final-answer marker: {answer[-120:]!r}; the format "
            f"is '<reasoning> #### <number>'"
        )
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def load_rows(path: str | os.PathLike[str]) -> list[Mapping[str, Any]]:
    """Rows of a ``.json`` (list of objects), ``.jsonl`` or ``.csv`` (header row) file."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{p}:{lineno}: invalid JSON ({e})") from e
        return rows
    if suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"{p} must hold a JSON list of row objects, got {type(data).__name__}")
        return data
    if suffix == ".csv":
        with p.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    raise ValueError(f"unsupported dataset file {p}; use .json, .jsonl or .csv")


class DatasetQAEnv(SingleAgentEnv):
    """One-step QA episodes over dataset rows (see the module docstring)."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        question_key: str = "question",
        answer_key: str = "answer",
        verifier: Verifier = exact_match_verifier,
        answer_extractor: AnswerExtractor | None = None,
        prompt_template: str = "{question}",
        system_prompt: str | None = None,
    ) -> None:
        if len(rows) == 0:
            raise ValueError("DatasetQAEnv got an empty dataset; give at least one row")
        columns = getattr(rows, "column_names", None)  # a datasets.Dataset
        if columns is not None:
            missing = [k for k in (question_key, answer_key) if k not in columns]
            if missing:
                raise ValueError(
                    f"dataset has no column(s) {missing}; its columns are {list(columns)}; "
                    f"set question_key=/answer_key="
                )
        else:
            for i, row in enumerate(rows):
                missing = [k for k in (question_key, answer_key) if k not in row]
                if missing:
                    raise ValueError(
                        f"row {i} has no key(s) {missing}; its keys are {sorted(row)}; set "
                        f"question_key=/answer_key= to the dataset's field names"
                    )
        if "{question}" not in prompt_template:
            raise ValueError(f"prompt_template={prompt_template!r} must contain '{{question}}'")
        self.rows = rows
        self.question_key = question_key
        self.answer_key = answer_key
        self.verifier = verifier
        self.answer_extractor = answer_extractor
        self.prompt_template = prompt_template
        self._system_prompt = system_prompt
        self._index: int | None = None
        self._question: str | None = None
        self._reference: str | None = None
        self._completion: str | None = None

    # -- constructors ---------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> DatasetQAEnv:
        rows = load_rows(path)
        if not rows:
            raise ValueError(f"{path} holds no rows")
        return cls(rows, **kwargs)

    @classmethod
    def gsm8k(cls, path: str | os.PathLike[str], **kwargs: Any) -> DatasetQAEnv:
        """GSM8K-format file: answers end in ``#### <number>``, checked numerically."""
        kwargs.setdefault("answer_extractor", gsm8k_extract_answer)
        kwargs.setdefault("verifier", numeric_verifier)
        return cls.from_file(path, **kwargs)

    @classmethod
    def from_hf(
        cls,
        name: str,
        split: str = "train",
        question_key: str = "question",
        answer_key: str = "answer",
        *,
        config_name: str | None = None,
        **kwargs: Any,
    ) -> DatasetQAEnv:
        """Rows of a Hugging Face dataset, e.g. ``from_hf("openai/gsm8k", "test",
        config_name="main", answer_extractor=gsm8k_extract_answer,
        verifier=numeric_verifier)``. Needs the optional ``datasets`` package."""
        try:
            import datasets  # optional (the datasets extra): only this constructor needs it
        except ImportError as e:
            raise ImportError(
                "DatasetQAEnv.from_hf needs the 'datasets' package: pip install datasets"
            ) from e
        ds = datasets.load_dataset(name, config_name, split=split)
        return cls(ds, question_key=question_key, answer_key=answer_key, **kwargs)

    # -- env ----------------------------------------------------------------------------

    @property
    def suggested_system_prompt(self) -> str | None:
        return self._system_prompt

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> tuple[str, str]:
        """(question, reference answer) of row ``index``."""
        r = self.rows[index]
        answer = str(r[self.answer_key])
        if self.answer_extractor is not None:
            answer = self.answer_extractor(answer)
        return str(r[self.question_key]), answer

    def env_reset(self, *, seed: int | None = None) -> tuple[Obs, Info]:
        s = random.randrange(2**31) if seed is None else seed
        self._index = s % len(self.rows)
        self._question, self._reference = self.row(self._index)
        self._completion = str(self.rows[self._index][self.answer_key])
        return self.env_current_obs(), {"seed": s, "row_index": self._index}

    def env_step(self, action: str) -> StepOutcome:
        if self._reference is None:
            raise RuntimeError("DatasetQAEnv.env_step called before env_reset")
        correct = bool(self.verifier(action, self._reference))
        return StepOutcome(
            obs="correct" if correct else f"wrong, the answer was {self._reference}",
            reward=1.0 if correct else 0.0,
            terminated=True,
            info={"correct": correct, "answer": self._reference, "row_index": self._index},
        )

    def env_current_obs(self) -> Obs:
        if self._question is None:
            raise RuntimeError("DatasetQAEnv has no question before env_reset")
        return self.prompt_template.format(question=self._question)

    # ReferenceEnv (libludic/envs/reference.py): supervised data and checks from this env

    def reference_completion(self) -> str:
        """The row's answer as the dataset writes it (a GSM8K solution with its reasoning
        and ``#### n``), what supervised training imitates."""
        if self._completion is None:
            raise RuntimeError("DatasetQAEnv has no question before env_reset")
        return self._completion

    def score_completion(self, completion: str, reference: str) -> float:
        """The env's reward: ``verifier(completion, answer_extractor(reference))``."""
        if self.answer_extractor is not None:
            reference = self.answer_extractor(reference)
        return 1.0 if self.verifier(completion, reference) else 0.0


_ROWS: dict[str, list[Mapping[str, Any]]] = {}  # source -> its rows, read once per process
FORMATS = ("plain", "gsm8k")
VERIFIERS: dict[str, Verifier] = {"exact": exact_match_verifier, "numeric": numeric_verifier}


def dataset_qa_env(
    path: str | None = None,
    hf: dict[str, Any] | None = None,
    format: str = "plain",
    verifier: str = "exact",
    question_key: str = "question",
    answer_key: str = "answer",
    prompt_template: str = "{question}",
    system_prompt: str | None = None,
) -> DatasetQAEnv:
    """The ``dataset_qa`` env kind from plain data: a local file (``path``) or a HF dataset
    (``hf``: {name, split, config_name}); ``format="gsm8k"`` takes the answer after ``####``
    and compares numbers; ``verifier`` is ``"exact"`` or ``"numeric"``."""
    if format not in FORMATS:
        raise ValueError(f"dataset_qa format={format!r}: use one of {list(FORMATS)}")
    if verifier not in VERIFIERS:
        raise ValueError(f"dataset_qa verifier={verifier!r}: use one of {sorted(VERIFIERS)}")
    if (path is None) == (hf is None):
        raise ValueError("dataset_qa needs exactly one of path=<local file> or hf={name, split}")
    kw: dict[str, Any] = {
        "question_key": question_key,
        "answer_key": answer_key,
        "prompt_template": prompt_template,
        "system_prompt": system_prompt,
        "verifier": numeric_verifier if format == "gsm8k" else VERIFIERS[verifier],
    }
    if format == "gsm8k":
        kw["answer_extractor"] = gsm8k_extract_answer
    key = repr((path, sorted((hf or {}).items()), format, question_key, answer_key))
    if key not in _ROWS:
        src = (
            DatasetQAEnv.from_file(path, **kw) if path else DatasetQAEnv.from_hf(**(hf or {}), **kw)
        )
        _ROWS[key] = list(src.rows)
    return DatasetQAEnv(_ROWS[key], **kw)
