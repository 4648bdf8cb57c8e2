"""Where a sweep's runs execute: a local process pool, or one Ray task per run.

Both are ways of calling ``fn(item, threads)`` on every item; each yields ``(item, result)`` as
the calls finish, where ``result`` is what ``fn`` returned or the exception that killed the
process running it (a crashed worker). Ray is imported only when asked for.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from taskgeom.errors import EnvironmentRefused, TaskgeomError
from taskgeom.settings import kernels

Task = Callable[[Any, int], Any]  # fn(item, threads) -> result
Finished = Iterator[tuple[Any, Any]]  # (item, result or the exception that killed its process)

KINDS = ("local", "ray")


@dataclass(frozen=True)
class Executor:
    """How to run a sweep.

    ``local``: ``workers`` processes on this machine (1: in this process). ``ray``: one Ray task
    per run declaring ``cpus_per_run`` CPUs and ``gpus_per_run`` GPUs, on the cluster at
    ``address`` (HOST:PORT) or else on a local Ray instance of ``workers`` x ``cpus_per_run`` CPUs.
    ``cpus_per_run`` is also each run's torch thread count; by default this machine's cores shared
    among the workers.
    """

    kind: str = "local"
    workers: int = 2
    address: str | None = None
    cpus_per_run: int | None = None
    gpus_per_run: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TaskgeomError(f"unknown executor {self.kind!r}; choose {' or '.join(KINDS)}")
        if self.workers < 1:
            raise TaskgeomError(f"--workers must be at least 1, got {self.workers}")
        if self.cpus_per_run is not None and self.cpus_per_run < 1:
            raise TaskgeomError(f"--cpus-per-run must be at least 1, got {self.cpus_per_run}")
        if self.gpus_per_run < 0 or (self.gpus_per_run > 1 and not float(self.gpus_per_run).is_integer()):
            raise TaskgeomError(
                f"--gpus-per-run must be a fraction in [0, 1] or a whole number of GPUs, got {self.gpus_per_run}"
            )
        if self.kind != "ray" and (self.address or self.gpus_per_run):
            raise TaskgeomError("--address and --gpus-per-run need --executor ray")
        if self.address:
            _split_address(self.address)

    def check(self) -> None:
        """Before any work: for Ray, that it imports (TaskgeomError naming the extra) and that
        ``address`` answers (EnvironmentRefused, exit code 3). A sweep or reproduction calls this
        first, so a missing or unreachable Ray never waits behind minutes of training."""
        if self.kind == "ray":
            _import_ray()
            if self.address:
                _check_reachable(self.address)

    @property
    def threads(self) -> int:
        return self.cpus_per_run or max(1, (os.cpu_count() or 1) // self.workers)


def execute(fn: Task, items: list, executor: Executor) -> Finished:
    """Call ``fn(item, threads)`` for every item on ``executor``; yields ``(item, result)`` in the
    order the calls finish."""
    if executor.kind == "ray":
        yield from _on_ray(fn, items, executor)
    elif executor.workers == 1:
        for item in items:
            yield item, fn(item, executor.cpus_per_run or 0)
    else:
        yield from _on_pool(fn, items, executor)


def _exit_with_parent(parent: int) -> None:
    """Pool worker initializer: end this worker when the process that started it is gone (killed,
    or stopped by a signal that runs no cleanup), instead of training on, holding its run's lock."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


# [measured] The environment of the processes a local pool starts. OMP_WAIT_POLICY=PASSIVE: a torch
# thread waiting for another sleeps instead of spinning (the bits are the same). The M1 analysis of a
# quick E2 run at two threads beside two busy one-thread processes took 0.42x the wall and 0.38x the CPU
# time it takes spinning; alone, 1.24x the wall and 0.98x the CPU (benchmarks/wait_policy.py, 2-core AMD
# EPYC, 7a2bd5c). A value the user set is kept.
WORKER_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}


def worker_environment() -> dict[str, str]:
    """``WORKER_ENVIRONMENT``, with the values this process's environment already sets."""
    return {name: os.environ.get(name, value) for name, value in WORKER_ENVIRONMENT.items()}


def local_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes on this machine, each started fresh (``spawn``) with this
    process's environment and ``WORKER_ENVIRONMENT``, ending when this process is gone, and (Python
    3.11 on) replaced after each call, so that no call inherits the memory an earlier one left held
    by the allocator: a worker's peak is its own call's."""
    os.environ.update(worker_environment())  # read by the workers' OpenMP as torch loads it
    return ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_exit_with_parent,
        initargs=(os.getpid(),),
        **({"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}),
    )


def _on_pool(fn: Task, items: list, executor: Executor) -> Finished:
    with local_pool(executor.workers) as pool:
        futures = {pool.submit(fn, item, executor.threads): item for item in items}
        for future in as_completed(futures):
            try:
                result = future.result()
            except Exception as err:  # the worker process itself died
                result = err
            yield futures[future], result


def _on_ray(fn: Task, items: list, executor: Executor) -> Finished:
    """One Ray task per item, gathered with ``ray.wait`` as they finish. Connects to (or starts)
    Ray unless this process already has, and disconnects (or stops) only what it started. Tasks
    are not retried: a crashed worker's item comes back as a failure, like a dead pool process."""
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        try:
            if executor.address:
                _check_reachable(executor.address)
                ray.init(address=executor.address)
            else:
                ray.init(num_cpus=executor.workers * executor.threads, include_dashboard=False)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise EnvironmentRefused(
                f"Ray did not start{f' at {executor.address}' if executor.address else ''}: {err}"
            ) from None
    try:
        _check_resources([node["Resources"] for node in ray.nodes() if node.get("Alive")], executor)
        pins = {
            **worker_environment(),
            **kernels.environment(),
        }  # a node's worker starts with the kernels this process chose
        task = ray.remote(
            num_cpus=executor.threads,
            num_gpus=executor.gpus_per_run,
            max_retries=0,
            **({"runtime_env": {"env_vars": pins}} if pins else {}),
        )(fn)
        pending = {task.remote(item, executor.threads): item for item in items}
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as err:  # the task raised, or its worker died
                result = err
            yield pending.pop(ref), result
    finally:
        if started:
            ray.shutdown()


def _import_ray():
    try:
        import ray
    except ImportError:
        raise TaskgeomError("the Ray executor needs `pip install taskgeom[ray]`") from None
    return ray


def _check_resources(nodes: list[dict[str, float]], executor: Executor) -> None:
    """A task asking for more than any one node holds would wait forever: refuse it now
    (EnvironmentRefused: the cluster cannot give it).

    nodes: the resources of each live node ({"CPU": 16.0, "GPU": 2.0, ...})."""
    for name, wanted in (("CPU", executor.threads), ("GPU", executor.gpus_per_run)):
        largest = max((node.get(name, 0) for node in nodes), default=0)
        if wanted > largest:
            raise EnvironmentRefused(
                f"each run asks for {wanted:g} {name} (--{name.lower()}s-per-run) but no node of the Ray cluster "
                f"has more than {largest:g}"
            )


def _split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of HOST:PORT or ray://HOST:PORT; None for ``auto``; TaskgeomError otherwise."""
    if address == "auto":
        return None
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not host or not port.isdigit():
        raise TaskgeomError(f"--address {address!r} must look like HOST:PORT (or ray://HOST:PORT, or auto)")
    return host, int(port)


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Refuse (EnvironmentRefused) an address whose HOST:PORT does not answer within ``timeout``
    seconds (Ray itself retries for minutes); ``auto`` (the cluster this machine belongs to) is left to Ray."""
    where = _split_address(address)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as err:
        raise EnvironmentRefused(f"no Ray cluster answers at {address} ({err})") from None
