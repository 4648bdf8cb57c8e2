"""The building blocks of validated settings, shared by ``config`` and every family's own settings
model: strict field types (counts are integers in the YAML sense only, real numbers finite and never
a boolean), the frozen base model that rejects unknown keys, and the settings every task family has
(``TaskSettings``; ``TokenTaskSettings`` adds the sequence length of a token family)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict
from pydantic_core import PydanticCustomError


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a number, not a boolean")
    return value


# Counts are integers in the YAML sense only: true, 1.0 and "3" are refused (pydantic would read them as 1, 1, 3).
Int = Annotated[int, Strict()]
PositiveInt = Annotated[int, Strict(), Field(gt=0)]
# Real numbers: finite (StrictModel sets allow_inf_nan=False) and never a boolean.
Real = Annotated[float, BeforeValidator(_not_bool)]
PositiveFloat = Annotated[float, BeforeValidator(_not_bool), Field(gt=0)]


class StrictModel(BaseModel):
    """Settings that reject unknown keys and infinite or NaN numbers, and never change once made."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TaskSettings(StrictModel):
    """What every family's ``task`` section has: the task pool (K majors, 2**k minors, their share of
    the prior). A family's own settings model subclasses this (or ``TokenTaskSettings``) and adds the
    keyword arguments of its constructor, with their defaults; the registry adds ``family``."""

    # the fields that shape the pool or the sequences, not the family: never passed to its constructor
    pool_fields: ClassVar[frozenset[str]] = frozenset({"family", "n_major", "diversity", "p_minor", "seq_len"})

    n_major: PositiveInt = 3
    diversity: Int = Field(-1, ge=-1, le=20, description="k: 2**k minor tasks; -1 means majors only")
    p_minor: Real = Field(0.1, ge=0.0, lt=1.0)

    def length_setting(self) -> str:
        """How a message names the setting that fixes ``seq_len`` (model positions per sequence: a
        field of token families, derived by vector families): ``task.seq_len (64)``."""
        return f"task.seq_len ({self.seq_len})"

    def family_arguments(self) -> dict[str, Any]:
        """The keyword arguments of the family's constructor: every setting but the pool's."""
        return {name: getattr(self, name) for name in type(self).model_fields if name not in self.pool_fields}


class TokenTaskSettings(TaskSettings):
    """A token family's settings: the pool's and the sequence length."""

    seq_len: PositiveInt = 64
