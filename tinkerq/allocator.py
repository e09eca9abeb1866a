"""Giving freed heap memory back to the OS. Python's and glibc's allocators keep what a process frees for reuse:
a long-running process whose allocations vary in size (a worker after a large request, the proxy passing
reads of every size) keeps its RSS near its peak, or creeps upward as the heap fragments. ``gc.collect()``
gets the cycles; glibc's ``malloc_trim(0)`` returns the free pages of every arena (madvise).

No torch here: the worker (worker/memory/release.py) and the proxy (launcher/proxy.py) share it.
"""

from __future__ import annotations

import ctypes
import gc
import platform
from typing import Any


def _glibc() -> Any | None:
    """The C library when it is glibc (malloc_trim is a glibc extension), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


GLIBC = _glibc()


def trim_heap() -> None:
    """Collect garbage, then give the allocators' free memory back to the OS (where the C library is glibc)."""
    gc.collect()
    if GLIBC is not None:
        GLIBC.malloc_trim(0)
