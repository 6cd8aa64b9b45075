"""What a code sandbox enforces is reported once it is probed: a log line at start and the
actor's ``ludic_actor_sandbox_info`` gauge, labelled with the guarantees it holds here."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from prometheus_client import REGISTRY

from libludic.envs.code_exec.sandbox import SubprocessSandbox, described_sandboxes
from services.actor.worker import export_sandboxes


def test_a_probed_sandbox_is_logged_and_exported(caplog) -> None:
    work_root = tempfile.mkdtemp(prefix="ludic-test-sbx-")  # traversable by a fresh uid
    os.chmod(work_root, 0o755)
    try:
        sb = SubprocessSandbox(isolation="auto", work_root=work_root)
        with caplog.at_level(logging.INFO, logger="libludic.envs.code_exec.sandbox"):
            desc = sb.describe()
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    assert f"code sandbox: {desc}" in caplog.text
    assert desc in described_sandboxes()
    export_sandboxes()
    labels = {
        "mode": str(desc["mode"]),
        "runs_as_fresh_uid": str(desc["runs_as_fresh_uid"]).lower(),
        "network_isolated": str(desc["network_isolated"]).lower(),
        "environment_private": str(desc["environment_private"]).lower(),
        "allowed_without": "",
    }
    assert REGISTRY.get_sample_value("ludic_actor_sandbox_info", labels) == 1.0
