"""tinkerq's own threads: named in Python and in the OS.

Python (before 3.14) does not give a thread's name to its OS thread, so ``top -H``, ``ps -T``, ``/proc/PID/task/*/comm``
and per-thread CPU accounting show every thread of a worker or gateway as ``python``. :class:`NamedThread` sets the
OS name too (Linux; elsewhere nothing), as ``tq-`` and the name without its ``tinkerq-`` prefix, cut to the 15
bytes Linux keeps: ``tinkerq-compute`` is ``tq-compute``. benchmarks/sampling_threads.py reads them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable
from typing import Any

_PR_SET_NAME = 15  # linux/prctl.h
_OS_NAME_BYTES = 15  # TASK_COMM_LEN - 1
_libc: Any = None


def os_name(name: str) -> str:
    """The OS thread name of a thread called ``name``."""
    short = name.removeprefix("tinkerq-")
    return ("tq-" + short if short != name else name).encode()[:_OS_NAME_BYTES].decode(errors="ignore")


def set_os_name(name: str) -> None:
    """Name the calling OS thread (Linux); never raises: a name is for people, not for correctness."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(os_name(name).encode()), 0, 0, 0)


class NamedThread(threading.Thread):
    """A daemon thread (unless told otherwise) that names its OS thread after itself when it starts."""

    def __init__(self, target: Callable[..., Any], name: str, args: tuple[Any, ...] = (), daemon: bool = True) -> None:
        super().__init__(target=target, name=name, args=args, daemon=daemon)

    def run(self) -> None:
        set_os_name(self.name)
        super().run()
