"""The held-out evaluation runs the task's protocol: ``up.eval_protocol`` (and the eval
service's ``protocol``, falling back to it) reaches every eval request, so a chat task is
scored through the same parser as in training."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from libludic.requests import ProtocolSpec
from services.common.heldout import eval_requests, evaluate_client
from services.common.settings import load_settings
from services.eval.settings import EvalSettings
from services.launcher.settings import UpSettings
from tests.fakes import ScriptedClient

LAST_INTEGER = {"kind": "regex", "pattern": r"(-?\d+)\D*$"}
PROTOCOL = {"kind": "single_agent", "kwargs": {"parser": LAST_INTEGER}}
ENV = {
    "kind": "arithmetic",
    "kwargs": {"split": "eval", "digits": 1, "prompt": "What is {a} + {b}?"},
}


def sentence_with_the_sum(request) -> str:
    a, b = map(int, re.findall(r"\d+", request.messages[-1]["content"])[:2])
    return f"{a} + {b} = {a + b}"


def test_eval_requests_carry_the_protocol():
    reqs = eval_requests(ENV, 3, 32, PROTOCOL)
    assert [r.env_seed for r in reqs] == [0, 1, 2]
    assert all(r.protocol == ProtocolSpec("single_agent", {"parser": LAST_INTEGER}) for r in reqs)
    assert eval_requests(ENV, 1, 32)[0].protocol == ProtocolSpec()  # none: identity parser


async def test_a_sentence_scores_with_the_tasks_parser_and_not_without():
    # every reply is right, in a sentence: the parser extracts the sum (pass rate 4/4);
    # the identity parser compares the whole sentence "a + b = s" with "s" (0/4)
    with_parser = await evaluate_client(
        ScriptedClient([sentence_with_the_sum]), ENV, 4, 32, PROTOCOL
    )
    bare = await evaluate_client(ScriptedClient([sentence_with_the_sum]), ENV, 4, 32)
    assert with_parser["eval/pass_rate"] == 1.0 and with_parser["eval/reward_mean"] == 1.0
    assert bare["eval/pass_rate"] == 0.0 and bare["eval/reward_mean"] == 0.0


def test_up_eval_protocol_is_checked_at_start_up():
    assert UpSettings(eval_protocol=PROTOCOL).eval_protocol == PROTOCOL
    with pytest.raises(ValueError, match=r"up.eval_protocol=.*parser.kind='nope' is unknown"):
        UpSettings(eval_protocol={"kind": "single_agent", "kwargs": {"parser": "nope"}})
    with pytest.raises(ValueError, match=r"up.eval_protocol=.*mapping with 'kind'"):
        UpSettings(eval_protocol={"kwargs": {"parser": "boxed"}})


def test_eval_service_protocol_falls_back_to_up(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump({"up": {"eval_env": ENV, "eval_protocol": PROTOCOL, "eval_n": 7}})
    )

    def load(*argv: str, **env: str) -> EvalSettings:
        return load_settings(
            EvalSettings, ["--config", str(cfg), *argv], service="eval", environ=env
        )

    s = load()
    assert (s.protocol, s.env, s.n) == (PROTOCOL, ENV, 7)
    assert s.every_steps == UpSettings().eval_every_steps == 10  # the launcher's default
    own = {"kind": "single_agent", "kwargs": {"parser": "boxed"}}
    assert load("--protocol", json.dumps(own)).protocol == own  # a flag beats up:
    assert load(LUDIC_N="9").n == 9  # so does the environment
    cfg.write_text(
        yaml.safe_dump({"up": {"eval_env": ENV, "eval_n": 7}, "eval": {"n": 5, "protocol": own}})
    )
    assert (load().n, load().protocol) == (5, own)  # eval's own section beats up:
    with pytest.raises(ValueError, match="eval.protocol="):
        load("--protocol", json.dumps({"kind": "single_agent", "kwargs": {"parser": 3}}))
