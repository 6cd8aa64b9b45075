"""Tools for the agentic workloads of bench/e2e.py: a tool with the wall time of a remote one.

``calculator`` waits ``LATENCY_S`` (200 ms, an external API or a remote sandbox), then
returns what libludic's registered ``calculator`` returns. It keeps that tool's name and
signature, so a model warm-started on ``calculator`` calls (``up.sft_task: {kind: tool}``,
which writes its demonstrations with the registered tool) calls this one the same way. A
run config names it by import path: ``tools: [bench.agentic_tools:calculator]``, with the
repository root on the services' ``sys.path``.
"""

from __future__ import annotations

import time

from libludic.agents import tools

LATENCY_S = 0.2


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."""
    time.sleep(LATENCY_S)  # blocks its worker thread, as a synchronous HTTP client would
    return tools.calculator(expression)
