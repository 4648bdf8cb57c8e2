"""Where a sweep's runs execute: a local process pool, or one Ray task per run.

Both are ways of calling ``fn(item, threads)`` on every item; each yields ``(item, result)`` as
the calls finish, where ``result`` is what ``fn`` returned or the exception that killed the
process running it (a crashed worker). Ray is imported only when asked for.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from taskgeom.errors import TaskgeomError

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
            raise TaskgeomError(f"--gpus-per-run must be a fraction in [0, 1] or a whole number of GPUs, got {self.gpus_per_run}")
        if self.kind != "ray" and (self.address or self.gpus_per_run):
            raise TaskgeomError("--address and --gpus-per-run need --executor ray")

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


def _on_pool(fn: Task, items: list, executor: Executor) -> Finished:
    with ProcessPoolExecutor(executor.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
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
    try:
        import ray
    except ImportError:
        raise TaskgeomError("the Ray executor needs `pip install taskgeom[ray]`") from None
    started = not ray.is_initialized()
    if started:
        if executor.address:
            ray.init(address=executor.address)
        else:
            ray.init(num_cpus=executor.workers * executor.threads, include_dashboard=False)
    try:
        _check_resources(ray.cluster_resources(), executor)
        task = ray.remote(num_cpus=executor.threads, num_gpus=executor.gpus_per_run, max_retries=0)(fn)
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


def _check_resources(total: dict[str, float], executor: Executor) -> None:
    """A task asking for more than the whole cluster holds would wait forever: refuse it now."""
    for name, wanted in (("CPU", executor.threads), ("GPU", executor.gpus_per_run)):
        if wanted > total.get(name, 0):
            raise TaskgeomError(f"each run asks for {wanted:g} {name} (--{name.lower()}s-per-run) but the whole Ray cluster "
                                f"has {total.get(name, 0):g}")
