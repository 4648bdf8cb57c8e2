"""A pool worker ends when the process that started it is killed, instead of training on; and it does one
call, so that no call starts with the memory an earlier one left held."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taskgeom.experiments.executors import local_pool

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


def _pid_and_holding(megabytes: int) -> int:
    ballast = bytearray(megabytes * 2**20)  # touched: resident
    del ballast
    return os.getpid()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="a worker replaced after each call needs Python 3.11")
def test_each_call_gets_a_fresh_worker():
    with local_pool(1) as pool:
        pids = [pool.submit(_pid_and_holding, 8).result() for _ in range(3)]
    assert len(set(pids)) == 3
