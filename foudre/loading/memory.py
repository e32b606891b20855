"""What loading holds resident: the memory a tensor's temporaries freed, given back before the
next tensor is read."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def release_freed() -> None:
    """Ask glibc's allocator to return to the system the memory freed since (a tensor's copy or
    decoding temporaries: its heap keeps freed blocks resident otherwise, and over a load they
    would add up to more than the weights); nothing elsewhere. Loaders call it once per tensor."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def releasing(items: Iterable[T]) -> Iterator[T]:
    """``items``, one at a time, with ``release_freed`` after each is consumed (what its
    consumer freed given back before the next is made)."""
    for item in items:
        yield item
        del item
        release_freed()
