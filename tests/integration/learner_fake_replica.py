"""A tiny stand-in for an inference replica's weight endpoints (no vLLM), for learner tests
and the bench: ``POST /v1/weights?version=N`` (safetensors body, bearer auth optional,
409 if N is not greater) and ``GET /v1/policy_version``. ``fail_first`` answers the first
k updates with 503; ``hang`` never answers updates (a blackholed replica)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class FakeReplica:
    def __init__(self, token: str | None = None, fail_first: int = 0, hang: bool = False):
        self.token = token
        self.fail_first = fail_first
        self.hang = hang
        self.version = 0
        self.updates: list[int] = []
        self.last_tensors: dict[str, Any] = {}
        self.peers: set[tuple[str, int]] = set()  # client (host, port) of every request
        self.lock = threading.Lock()
        self._release = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn: connections are reused

            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                outer.peers.add(self.client_address)
                if urlsplit(self.path).path == "/v1/policy_version":
                    self._send(200, {"policy_version": outer.version})
                else:
                    self._send(404, {"detail": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                outer.peers.add(self.client_address)
                u = urlsplit(self.path)
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n)
                if u.path != "/v1/weights":
                    self._send(404, {"detail": "not found"})
                    return
                if outer.hang:
                    outer._release.wait(600)
                    return
                if outer.token and self.headers.get("Authorization") != f"Bearer {outer.token}":
                    self._send(401, {"detail": "bad token"})
                    return
                version = int(parse_qs(u.query)["version"][0])
                with outer.lock:
                    if outer.fail_first > 0:
                        outer.fail_first -= 1
                        self._send(503, {"detail": "drain timed out"})
                        return
                    if version <= outer.version:
                        self._send(409, {"detail": f"version {version} <= {outer.version}"})
                        return
                    from safetensors.torch import load

                    try:
                        outer.last_tensors = load(body)
                    except Exception as e:  # corrupt body -> 400, as the real service
                        self._send(400, {"detail": str(e)})
                        return
                    outer.version = version
                    outer.updates.append(version)
                self._send(200, {"policy_version": version, "pause_s": 0.0})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeReplica:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()
