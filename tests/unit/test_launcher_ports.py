"""Ports for the services of `ludic up` come from below the kernel's ephemeral range (where
the local ports of outgoing connections are drawn), free, and never twice."""

from __future__ import annotations

import socket

from services.launcher import stack


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    lo, _ = stack.ephemeral_range()
    ports = [stack.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= p < lo for p in ports)
    for p in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", p))  # free: a service can bind it


def test_a_taken_port_is_not_handed_out(monkeypatch) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("0.0.0.0", 0))
    port = taken.getsockname()[1]
    draws = iter([port, port, port + 1, port + 2])
    monkeypatch.setattr(stack.random, "randrange", lambda a, b: next(draws))
    monkeypatch.setattr(stack, "ephemeral_range", lambda: (65000, 65535))
    try:
        assert stack.free_port() in (port + 1, port + 2)
    finally:
        taken.close()
