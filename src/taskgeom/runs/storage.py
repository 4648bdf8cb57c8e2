"""Atomic file writes, safetensors checkpoints that refuse foreign or damaged files, and the
exclusive lock that keeps one writer per run directory.

Files are written to a uniquely named temporary file beside their target, then renamed over it,
with the mode an ordinary ``open`` would give them (0666 less the umask).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from taskgeom.errors import CheckpointError, EnvironmentRefused, RunLockedError, TaskgeomError

CHECKPOINT_FORMAT = "taskgeom-checkpoint-1"


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not atomic, but only where /proc is missing)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open`` gives a new file: 0666 less the umask."""
    return 0o666 & ~current_umask()


def temp_path(path: Path) -> Path:
    """A new, uniquely named empty file beside ``path`` (``.NAME.XXXXXXXX.tmp``) with the mode of
    ``file_mode``; the caller writes it and renames it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())
    finally:
        os.close(fd)
    return Path(tmp)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a uniquely named temporary file beside ``path``, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write_bytes`` of ``text`` as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def standard_json(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (standard JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: standard_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [standard_json(v) for v in value]
    return value


def atomic_write_json(path: Path, payload: Any) -> None:
    atomic_write_text(path, json.dumps(payload, indent=1, sort_keys=True) + "\n")


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Atomic safetensors write with string metadata (``format`` added)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        data = save(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
            metadata={"format": CHECKPOINT_FORMAT, **meta},
        )
        with open(tmp, "wb") as handle:
            handle.write(_ordered_header(data))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _ordered_header(data: bytes) -> bytes:
    """The safetensors bytes with their JSON header written in sorted key order, so that equal
    tensors and metadata give equal files (safetensors writes the metadata map in a random order).
    The header keeps its length (padded with spaces, as safetensors pads it); only the order of
    its entries changes, so every tensor offset stays valid."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    if isinstance(header.get("__metadata__"), dict):
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    ordered = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    if len(ordered) > size:  # cannot happen for the same entries; keep the original rather than guess
        return data
    return data[:8] + ordered.ljust(size, b" ") + data[8 + size :]


def load_tensors(path: Path, digest: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a checkpoint written by ``save_tensors``; check its format and config digest."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({err})") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is not a taskgeom checkpoint (format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r})"
        )
    if digest is not None and meta.get("config_digest") != digest:
        raise CheckpointError(
            f"checkpoint {path} was written for config {meta.get('config_digest')}, not this run's config {digest}"
        )
    return tensors, meta


def load_module_state(module: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path, prefix: str = "") -> None:
    """Load ``tensors`` (keys under ``prefix``) into ``module``, naming any key or shape mismatch."""
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    expected = module.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(
                f"checkpoint {path}: {key} has shape {tuple(value.shape)}, the model expects {tuple(expected[key].shape)}"
            )
    module.load_state_dict(state)


def meta_int(meta: dict[str, str], key: str, path: Path, low: int, high: int, remedy: str) -> int:
    """The integer ``meta[key]`` of checkpoint ``path``, within ``low..high``; else CheckpointError
    naming the value, the allowed range and ``remedy``."""
    raw = meta.get(key)
    try:
        value = int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = None
    if value is None or not low <= value <= high:
        found = "is missing" if raw is None else f"is {raw!r}"
        raise CheckpointError(
            f"checkpoint {path}: metadata {key!r} {found}, expected an integer in {low}..{high}; {remedy}"
        )
    return value


def meta_float(meta: dict[str, str], key: str, path: Path, remedy: str) -> float:
    """The finite float ``meta[key]`` of checkpoint ``path``; else CheckpointError with ``remedy``."""
    raw = meta.get(key)
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        found = "is missing" if raw is None else f"is {raw!r}"
        raise CheckpointError(f"checkpoint {path}: metadata {key!r} {found}, expected a finite number; {remedy}")
    return value


@contextlib.contextmanager
def exclusive_lock(path: Path, what: str, refused: type[TaskgeomError] = RunLockedError) -> Iterator[None]:
    """Hold an exclusive OS lock (flock) on the file ``path`` for the ``with`` block, writing this
    process id into it. Never waits: if another process holds it, ``refused`` naming ``what``,
    the lock file and the holder's process id. The kernel releases the lock when the process
    ends, however it ends, so a lock file left by a killed process does not block. The file is
    kept (removing it would let two processes lock two different files of one name)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        raise EnvironmentRefused(f"cannot open the lock file {path}: {err.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise EnvironmentRefused(f"cannot lock {path}: {err.strerror}") from None
            raise refused(
                f"{what} is being written by another process ({_holder(fd)}, holding the lock {path}); "
                "wait for it to finish, or stop it"
            ) from None
        mine = f"{os.getpid()} {socket.gethostname()}\n".encode()
        if os.pread(fd, 256, 0) != mine:  # left as it is when it names this process already
            os.ftruncate(fd, 0)
            os.pwrite(fd, mine, 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    """'pid N on host H' from a lock file another process holds. The holder writes its id just
    after taking the lock, so an empty file, or one still naming the previous holder (this
    process, when it made the run directory), is read again for up to 0.2 s."""
    mine = f"{os.getpid()} {socket.gethostname()}"
    text = ""
    for _ in range(20):
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
        if text and text != mine:
            break
        time.sleep(0.01)
    pid, _, host = text.partition(" ")
    return f"pid {pid or 'unknown'}" + (f" on host {host}" if host else "")
