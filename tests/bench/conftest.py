"""Fixtures of the benchmark tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run torch on one thread: the tiny test models are faster so, and far less sensitive to
    other load on a 2-core machine (no thread-pool barriers per op)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
