"""tinkerq's threads carry their names into the OS (tinkerq/threads.py): what top -H, ps -T and /proc show."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from tinkerq.threads import NamedThread, os_name

pytestmark = pytest.mark.timeout(30)


def test_os_names_fit_linux_and_keep_what_tells_them_apart():
    assert os_name("tinkerq-compute") == "tq-compute"
    assert os_name("tinkerq-sample-intake") == "tq-sample-intak"  # 15 bytes: the kernel keeps no more
    assert os_name("tinkerq-gw-answers") == "tq-gw-answers"
    assert os_name("other") == "other"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are read from /proc")
def test_a_named_thread_names_its_os_thread():
    seen: list[str] = []
    ready = threading.Event()

    def body() -> None:
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())
        ready.set()

    thread = NamedThread(body, "tinkerq-sample-intake")
    assert thread.daemon and thread.name == "tinkerq-sample-intake"
    thread.start()
    assert ready.wait(10)
    thread.join(10)
    assert seen == ["tq-sample-intak"]
    # the thread that started it keeps its own name
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip() != "tq-sample-intak"


def test_a_named_thread_passes_its_arguments():
    got: list[int] = []
    thread = NamedThread(got.append, "tinkerq-test", args=(7,), daemon=False)
    assert not thread.daemon
    thread.start()
    thread.join(10)
    assert got == [7]
