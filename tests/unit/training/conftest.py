"""One intra-op thread for the training unit tests.

The models here are tiny; on a shared 2-core machine two OpenMP threads per process spin
against other processes and make each step ~50x slower than one thread does.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
