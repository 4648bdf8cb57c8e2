"""A pool worker ends when the process that started it is killed, instead of training on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_PARENT = """
import sys, time
from taskgeom.experiments.executors import Executor, execute
from tests.test_pool_workers import record_and_sleep
for _ in execute(record_and_sleep, [sys.argv[1] + "/a", sys.argv[1] + "/b"], Executor(workers=2)):
    pass
"""


def record_and_sleep(path: str, _threads: int) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pool_workers_end_when_their_parent_is_killed(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], cwd=Path(__file__).parent.parent)
    files = [tmp_path / "a", tmp_path / "b"]
    deadline = time.monotonic() + 60
    while not all(f.is_file() and f.read_text() for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = [int(f.read_text()) for f in files]
    assert all(_alive(pid) for pid in workers)
    parent.send_signal(signal.SIGKILL)  # no cleanup runs in the parent
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers)
