"""One source of randomness: every draw is a pure function of (seed, step, stream)."""

from __future__ import annotations

import hashlib

import torch


def fold_seed(seed: int, step: int, stream: str) -> int:
    """A 63-bit integer determined by (seed, step, stream) alone, stable across processes."""
    digest = hashlib.blake2b(f"{seed}/{stream}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(seed: int, step: int = 0, stream: str = "train") -> torch.Generator:
    """A CPU torch.Generator seeded from (seed, step, stream)."""
    return torch.Generator().manual_seed(fold_seed(seed, step, stream))
