"""CodeExecEnv: the agent answers a programming problem with Python code; tests decide.

A problem is a prompt plus tests. Two kinds of test, mixable within one problem:

- **io** ``{"stdin": "1 2\\n", "expected_stdout": "3\\n"}`` (aliases ``input``/``output``):
  the code runs as a script with that stdin; it passes when its stdout equals the expected
  one after normalisation (trailing whitespace of every line and trailing blank lines
  dropped) and it exited 0.
- **assert** ``{"assert": "assert add(1, 2) == 3"}``: the snippet is appended to the code
  (after a blank line) and the script runs with empty stdin; it passes when it exits 0 and
  a random sentinel printed after the snippet is the last stdout line, so a solution that
  calls ``sys.exit(0)``/``os._exit(0)`` before the asserts does not pass. (Code running in
  the same interpreter as its asserts can still cheat by introspection or by returning an
  object whose ``__eq__`` is always true; prefer io tests where the policy is adversarial.)

Scoring over the n = min(len(tests), max_tests) selected tests, passed = p:
reward = 1.0 if p == n else 0.0; with ``partial_credit`` reward = p / n. With
``stop_on_first_failure`` the tests after the first failure are not run and count as
failed (reason ``"skipped"``).

``info["tests"]`` holds one dict per selected test: ``index``, ``kind``, ``passed``,
``reason`` (``"ok"``, ``"wrong_output"``, ``"assertion_failed: ..."``, ``"timeout"``,
``"memory"``, ``"runtime_error: ..."``, ``"killed: too many processes"``,
``"output_limit"``, ``"killed: SIGSEGV"``, ``"exited_early"``, ``"skipped"``), ``duration_s``
and truncated ``stdout``/``stderr``.

``env_step`` blocks for up to n * timeout_per_test_s; inside an event loop use
``env_step_async``. The action may be plain code or contain Markdown fences
(:func:`extract_code`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from libludic.envs.code_exec.config import CodeExecConfig
from libludic.envs.code_exec.sandbox import Sandbox, SubprocessSandbox
from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.types import Info, Obs, StepOutcome

DEFAULT_SYSTEM_PROMPT = (
    "Solve the programming problem in Python 3. Reply with the complete program in one "
    "```python code block. Read input from stdin and print the answer unless the problem "
    "asks for a function."
)

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*)\Z", re.DOTALL)
_PY_TAGS = ("python", "py", "python3")
_SNIPPET = 2000


def extract_code(text: str) -> str:
    """The code in a model answer: the last ```` ```python ```` (or ``py``/``python3``)
    block, else the last untagged block, else an unclosed trailing fence (a truncated
    generation), else the whole text."""
    blocks = _FENCE_RE.findall(text)
    tagged = [body for tag, body in blocks if tag.lower() in _PY_TAGS]
    if tagged:
        return str(tagged[-1]).strip("\n")
    untagged = [body for tag, body in blocks if not tag]
    if untagged:
        return str(untagged[-1]).strip("\n")
    if not blocks:
        tail = text[text.rfind("```") :] if "```" in text else ""
        m = _OPEN_FENCE_RE.match(tail)
        if m:
            return m.group(2).strip("\n")
    return text.strip("\n")


def normalise_output(s: str) -> str:
    lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


@dataclass(frozen=True)
class CodeTest:
    """One test: io (``expected_stdout`` set) or assert (``assert_code`` set)."""

    stdin: str = ""
    expected_stdout: str | None = None
    assert_code: str | None = None

    def __post_init__(self) -> None:
        if (self.expected_stdout is None) == (self.assert_code is None):
            raise ValueError(
                "a CodeTest needs exactly one of expected_stdout (io test, with stdin) or "
                f"assert_code (assert test); got expected_stdout={self.expected_stdout!r}, "
                f"assert_code={self.assert_code!r}"
            )

    @property
    def kind(self) -> str:
        return "assert" if self.assert_code is not None else "io"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CodeTest:
        known = {"stdin", "input", "expected_stdout", "output", "assert"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"test has unknown keys {unknown}; use {sorted(known)}")
        stdin = d.get("stdin", d.get("input", ""))
        expected = d.get("expected_stdout", d.get("output"))
        return cls(
            stdin=str(stdin),
            expected_stdout=None if expected is None else str(expected),
            assert_code=None if d.get("assert") is None else str(d["assert"]),
        )

    def to_dict(self) -> dict[str, Any]:
        if self.assert_code is not None:
            return {"assert": self.assert_code}
        return {"stdin": self.stdin, "expected_stdout": self.expected_stdout}


@dataclass(frozen=True)
class CodeProblem:
    prompt: str
    tests: tuple[CodeTest, ...]
    id: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ValueError(f"CodeProblem {self.id!r} has an empty prompt")
        if not self.tests:
            raise ValueError(f"CodeProblem {self.id!r} has no tests; give at least one")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CodeProblem:
        for key in ("prompt", "tests"):
            if key not in d:
                raise ValueError(
                    f"problem {d.get('id')!r} has no {key!r} key; a problem is "
                    '{"id": ..., "prompt": ..., "tests": [{"stdin": ..., "expected_stdout": ...} '
                    'or {"assert": ...}]}'
                )
        return cls(
            prompt=str(d["prompt"]),
            tests=tuple(CodeTest.from_dict(t) for t in d["tests"]),
            id=None if d.get("id") is None else str(d["id"]),
        )


def load_problems(path: str | os.PathLike[str]) -> list[CodeProblem]:
    """Problems from a JSONL file, one ``CodeProblem.from_dict`` object a line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(CodeProblem.from_dict(json.loads(line)))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
    if not out:
        raise ValueError(f"{path} holds no problems")
    return out


@dataclass
class TestResult:
    __test__ = False  # not a pytest class

    index: int
    kind: str
    passed: bool
    reason: str
    duration_s: float = 0.0
    stdout: str = ""
    stderr: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "passed": self.passed,
            "reason": self.reason,
            "duration_s": round(self.duration_s, 4),
            "stdout": self.stdout,
            "stderr": self.stderr,
        }


def run_test(
    code: str, test: CodeTest, index: int, config: CodeExecConfig, sandbox: Sandbox
) -> TestResult:
    if test.assert_code is not None:
        sentinel = f"__ludic_tests_passed_{secrets.token_hex(8)}__"
        source = f"{code}\n\n{test.assert_code}\nprint({sentinel!r})\n"
        stdin = ""
    else:
        source, stdin = code, test.stdin
    r = sandbox.run(
        source,
        stdin=stdin,
        timeout_s=config.timeout_per_test_s,
        memory_limit_mb=config.memory_limit_mb,
    )
    if not r.ok:
        reason = r.reason
        if test.kind == "assert" and r.detail.startswith("AssertionError"):
            reason = f"assertion_failed: {r.detail}"
        passed = False
    elif test.assert_code is not None:
        last = r.stdout.rstrip("\n").rsplit("\n", 1)[-1]
        passed = last == sentinel
        reason = "ok" if passed else "exited_early"
    else:
        assert test.expected_stdout is not None
        passed = normalise_output(r.stdout) == normalise_output(test.expected_stdout)
        reason = "ok" if passed else "wrong_output"
    return TestResult(
        index=index,
        kind=test.kind,
        passed=passed,
        reason=reason,
        duration_s=r.duration_s,
        stdout=r.stdout[:_SNIPPET],
        stderr=r.stderr[-_SNIPPET:],
    )


def run_tests(
    code: str, tests: Sequence[CodeTest], config: CodeExecConfig, sandbox: Sandbox
) -> list[TestResult]:
    """Results for the selected tests (first ``max_tests``), in order; see module doc."""
    selected = list(tests)[: config.max_tests] if config.max_tests else list(tests)
    results: list[TestResult] = []
    failed = False
    for i, t in enumerate(selected):
        if failed and config.stop_on_first_failure:
            results.append(TestResult(index=i, kind=t.kind, passed=False, reason="skipped"))
            continue
        res = run_test(code, t, i, config, sandbox)
        failed = failed or not res.passed
        results.append(res)
    return results


def score(results: Sequence[TestResult], partial_credit: bool) -> float:
    """1.0 if all passed else 0.0; with ``partial_credit`` passed / len(results)."""
    if not results:
        return 0.0
    passed = sum(1 for r in results if r.passed)
    if partial_credit:
        return passed / len(results)
    return 1.0 if passed == len(results) else 0.0


_DEFAULT_SANDBOX: SubprocessSandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> SubprocessSandbox:
    """One process-wide ``SubprocessSandbox`` (re-entrant), so many envs probe once.
    ``LUDIC_SANDBOX_ALLOW`` (comma-separated guarantee names) lets it run without them."""
    global _DEFAULT_SANDBOX
    with _DEFAULT_LOCK:
        if _DEFAULT_SANDBOX is None:
            raw = os.environ.get("LUDIC_SANDBOX_ALLOW", "")
            allow = tuple(a.strip() for a in raw.split(",") if a.strip())
            _DEFAULT_SANDBOX = SubprocessSandbox(allow=allow)
        return _DEFAULT_SANDBOX


class CodeExecEnv(SingleAgentEnv):
    """One-step episodes: observe a problem prompt, answer with code, get the test reward.

    ``seed`` selects problem ``seed % len(problems)`` (None: a random one).
    """

    def __init__(
        self,
        problems: Sequence[CodeProblem],
        config: CodeExecConfig | None = None,
        sandbox: Sandbox | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    ) -> None:
        if not problems:
            raise ValueError("CodeExecEnv needs at least one problem; got an empty list")
        self.problems = list(problems)
        self.config = config or CodeExecConfig()
        self.sandbox: Sandbox = sandbox if sandbox is not None else default_sandbox()
        if isinstance(self.sandbox, SubprocessSandbox):
            self.sandbox.describe()  # probed once per sandbox: a missing guarantee fails here
        self._system_prompt = system_prompt
        self.problem: CodeProblem | None = None
        self._index: int | None = None

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str], **kwargs: Any) -> CodeExecEnv:
        return cls(load_problems(path), **kwargs)

    @property
    def suggested_system_prompt(self) -> str | None:
        return self._system_prompt

    def env_reset(self, *, seed: int | None = None) -> tuple[Obs, Info]:
        s = random.randrange(2**31) if seed is None else seed
        self._index = s % len(self.problems)
        self.problem = self.problems[self._index]
        return self.problem.prompt, {
            "seed": s,
            "problem_index": self._index,
            "problem_id": self.problem.id,
            "n_tests": len(self.problem.tests),
        }

    def env_step(self, action: str) -> StepOutcome:
        if self.problem is None:
            raise RuntimeError("CodeExecEnv.env_step called before env_reset")
        code = extract_code(action)
        info: dict[str, Any] = {"problem_id": self.problem.id, "code": code}
        if not code.strip():
            selected = self.problem.tests[: self.config.max_tests or None]
            results = [
                TestResult(index=i, kind=t.kind, passed=False, reason="no_code")
                for i, t in enumerate(selected)
            ]
        else:
            results = run_tests(code, self.problem.tests, self.config, self.sandbox)
        reward = score(results, self.config.partial_credit)
        n_passed = sum(1 for r in results if r.passed)
        info.update(
            tests=[r.to_dict() for r in results],
            passed=n_passed,
            total=len(results),
            all_passed=n_passed == len(results),
        )
        first_fail = next((r for r in results if not r.passed), None)
        obs = (
            f"all {len(results)} tests passed"
            if first_fail is None
            else f"{n_passed}/{len(results)} tests passed; test {first_fail.index} failed: "
            f"{first_fail.reason}"
        )
        return StepOutcome(obs=obs, reward=reward, terminated=True, info=info)

    async def env_step_async(self, action: str) -> StepOutcome:
        """``env_step`` in a worker thread, so the event loop keeps serving other episodes.

        ``env_step`` blocks for up to n * timeout_per_test_s; inside an event loop call
        ``await env.env_step_async(action)`` (or ``astep``), which runs it in a worker thread
        via ``asyncio.to_thread``. The sandbox is re-entrant, so many episodes can run
        concurrently (bounded by the default thread pool, ``min(32, cpus + 4)`` workers)."""
        return await asyncio.to_thread(self.env_step, action)

    async def astep(self, actions: dict[str, str]) -> dict[str, StepOutcome]:
        """Async counterpart of ``step``."""
        if self.agent_id not in actions:
            raise KeyError(
                f"CodeExecEnv.astep got actions for {sorted(actions)}; expected {self.agent_id!r}"
            )
        return {self.agent_id: await self.env_step_async(actions[self.agent_id])}

    def env_current_obs(self) -> Obs:
        if self.problem is None:
            raise RuntimeError("CodeExecEnv has no problem before env_reset")
        return self.problem.prompt


__all__ = [
    "CodeExecEnv",
    "CodeProblem",
    "CodeTest",
    "TestResult",
    "default_sandbox",
    "extract_code",
    "load_problems",
    "normalise_output",
    "run_tests",
    "score",
]


_PROBLEMS: dict[str, list[CodeProblem]] = {}  # problems_path -> its problems, read once


def code_exec_env(
    problems_path: str, config: dict[str, Any] | None = None, system_prompt: str | None = None
) -> CodeExecEnv:
    """The ``code_exec`` env kind from plain data: a JSONL of problems and CodeExecConfig
    fields (the file is read once per process)."""
    if problems_path not in _PROBLEMS:
        _PROBLEMS[problems_path] = load_problems(problems_path)
    return CodeExecEnv(
        _PROBLEMS[problems_path],
        config=CodeExecConfig(**(config or {})),
        system_prompt=DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt,
    )
