"""``RowFile``: rows written to a file in order and read back by index, as a tensor's rows."""

from __future__ import annotations

import pytest
import torch

from taskgeom.studies.e4.row_file import RowFile


def test_rows_read_by_index_are_the_rows_written(tmp_path):
    """Two appends, then reads in any order, with repeats: the floats of a tensor's indexing, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randn(7, 5, generator=gen), torch.randn(4, 5, generator=gen) * 1e-30
    rows = RowFile(tmp_path / "rows.f32", 5)
    rows.append(first)
    rows.append(second)
    whole = torch.cat([first, second])
    assert rows.shape == (11, 5) and rows.count == 11
    for index in (torch.arange(11), torch.tensor([10, 0, 3, 3, 9]), torch.randperm(11, generator=gen)[:6]):
        assert torch.equal(rows[index], whole[index])
    assert rows[torch.empty(0, dtype=torch.long)].shape == (0, 5)


def test_wrong_rows_and_indices_are_refused(tmp_path):
    """A row of another width or dtype is refused before anything is written; an index past the end fails."""
    rows = RowFile(tmp_path / "rows.f32", 3)
    rows.append(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\[n, 3\] float32"):
        rows.append(torch.ones(2, 4))
    with pytest.raises(ValueError, match="float32"):
        rows.append(torch.ones(2, 3, dtype=torch.float64))
    assert rows.count == 2 and (tmp_path / "rows.f32").stat().st_size == 2 * 3 * 4
    with pytest.raises(IndexError):
        rows[torch.tensor([2])]
