"""States kept in a file and read by row: E4's prefix-probe pool out of memory.

The study's probe draws its training rows again from the whole pool every few epochs, so every
row stays reachable to the end; held in memory the quick profile's pool is about 1.5 GB
(docs/benchmarks.md). A ``RowFile`` writes the rows once, in order, and maps the file only for
the length of one read, so the process holds what a read returns and no more; a read costs about
what a gather from memory costs. The rows read are the floats written, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class RowFile:
    """Rows [N, width] float32 written to ``path`` in order (``append``) and read by index
    (``rows[index]``); ``shape`` is (N, width) as a tensor's."""

    def __init__(self, path: Path, width: int):
        self.path, self.width, self.count = Path(path), width, 0
        self.path.write_bytes(b"")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.count, self.width)

    def append(self, rows: torch.Tensor) -> None:
        """Write rows: [n, width] float32 after those already written."""
        if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != self.width:
            raise ValueError(
                f"{self.path}: rows must be [n, {self.width}] float32, not {list(rows.shape)} {rows.dtype}"
            )
        with self.path.open("ab") as file:
            rows.detach().cpu().contiguous().numpy().tofile(file)
        self.count += rows.shape[0]

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """[len(index), width]: the rows at index ([k] long), in its order."""
        if index.numel() == 0 or self.count == 0:
            return torch.empty(0, self.width)[
                index
            ]  # an empty index reads nothing; any other on no rows fails as a tensor's
        mapped = np.memmap(self.path, dtype=np.float32, mode="r", shape=self.shape)
        rows = mapped[index.numpy()].view(np.ndarray)  # fancy indexing copies: the mapping is not kept
        del mapped
        return torch.from_numpy(rows)
