"""`make venv` on a machine with no pip configuration gets torch's CPU build from the extra
index.

A development host's pip configuration may list a local wheel directory holding
torch 2.13.0+cpu, which hides the path a user's fresh machine takes. Here the Makefile's own
torch line (read from `make -n venv`, not copied) runs in a clean container of the local
Debian base image: no /etc/pip.conf, no user config, no find-links. The PyTorch CPU index may
be unreachable from the test host, so a PEP 503 index serving the same wheel file stands in for
it (`TORCH_INDEX=http://127.0.0.1:<port>/simple`, exactly how a user would point the Makefile
at a mirror). pip must resolve `torch==2.13.0+cpu` from that extra index; PyPI, the default
index, has only the CUDA build (and is not trusted in the container here: no CA bundle).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from services.launcher.stack import free_port

pytestmark = pytest.mark.containers

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "ludic-local/python:bookworm"


def test_make_venv_torch_line_resolves_the_cpu_build_from_the_extra_index(tmp_path: Path) -> None:
    wheels = sorted(glob.glob("/opt/wheels/torch-2.13.0+cpu-*.whl"))
    if not wheels:
        pytest.fail("no torch-2.13.0+cpu wheel in /opt/wheels: the test serves it as the index")
    port = free_port()
    index = f"http://127.0.0.1:{port}/simple"
    dry = subprocess.run(
        ["make", "-n", "-B", "venv", "VENV=/v", "PYTHON=python3", f"TORCH_INDEX={index}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (line,) = [ln for ln in dry.splitlines() if "--extra-index-url" in ln and "torch==" in ln]
    line = line.split(" 2>&1")[0]  # drop the Makefile's noise filter
    assert re.search(r"--no-deps --extra-index-url \S+ 'torch==2\.13\.0\+cpu'", line), line
    # a PEP 503 index with the one CPU wheel (a hard link: no copy of 200 MB when possible)
    wheel = Path(wheels[0])
    (tmp_path / "simple" / "torch").mkdir(parents=True)
    try:
        os.link(wheel, tmp_path / "simple" / "torch" / wheel.name)
    except OSError:
        shutil.copy(wheel, tmp_path / "simple" / "torch" / wheel.name)
    href = wheel.name.replace("+", "%2B")
    (tmp_path / "simple" / "torch" / "index.html").write_text(
        f'<a href="{href}">{wheel.name}</a>\n'
    )
    script = (
        f"cd /idx && (python3 -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 &) && sleep 1 && "
        "python3 -m venv /v && test ! -e /etc/pip.conf && /v/bin/pip config list | grep -c . | grep -qx 0 && "
        f"{line} --retries 0 --timeout 5 && /v/bin/pip show torch | grep '^Version:'"
    )
    p = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "host",
            "-v",
            f"{tmp_path}:/idx:ro",
            IMAGE,
            "sh",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "Version: 2.13.0+cpu", p.stdout
