"""The schema of a run's config: pydantic models (unknown keys rejected, counts strictly integers,
real numbers finite) of its ``task`` section (the settings model of the family it names, from the
registry of ``taskgeom.tasks``), its ``model`` and its ``train`` sections; ``RunConfig.digest``
names its run directory. Recipes, profiles and dotted overrides make configs
(``taskgeom.settings.recipes``); the memory a config needs is training's
(``taskgeom.training.memory``)."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SerializeAsAny, Strict, ValidationError, field_validator, model_validator

from taskgeom.errors import TaskgeomError
from taskgeom.settings.fields import Int, PositiveFloat, PositiveInt, Real, StrictModel, TaskSettings
from taskgeom.tasks.registry import FamilyError, build_family, families, family_class, load_plugins, settings_model


class ConfigError(TaskgeomError, ValueError):
    """A configuration that cannot be run; the message names the field and what is allowed."""


def _task_settings(value: Any) -> Any:
    """A ``task`` section validated by the model of the family it names (``tasks.registry``)."""
    if isinstance(value, TaskSettings):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"config field 'task' must be a mapping of settings, got {describe_value(value)}")
    load_plugins()  # a plugin that fails to load: FamilyError, its message kept
    family = value.get("family")
    if family is None:
        raise ValueError(f"task.family is missing; registered families: {', '.join(sorted(families()))}")
    if not isinstance(family, str):
        raise ValueError(f"config field 'task.family' must name a family, got {describe_value(family)}")
    try:
        model = settings_model(family)
    except FamilyError as err:
        raise ValueError(f"config field 'task.family': {err}") from None
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise ValueError(describe_validation(err, ("task",))) from None


# The task section: any registered family's settings (kept as that family's model when dumped).
TaskConfig = Annotated[SerializeAsAny[TaskSettings], BeforeValidator(_task_settings)]


ARCH_POSITIONS = {"gpt2": "learned", "llama": "rotary"}  # the position scheme each Hugging Face architecture has


class ModelConfig(StrictModel):
    n_layers: PositiveInt = 2
    d_model: PositiveInt = 64
    n_heads: PositiveInt = 2
    d_mlp: PositiveInt = 256
    positions: Literal["rotary", "learned"] = Field(
        "rotary", description="fixed by arch for gpt2 (learned) and llama (rotary)"
    )
    max_len: PositiveInt = 256
    arch: Literal["taskgeom", "gpt2", "llama"] = Field(
        "taskgeom", description="gpt2, llama: a Hugging Face model (taskgeom.models.hf)"
    )
    activation: Literal["gelu", "silu"] = Field(
        "gelu", description="the MLP's nonlinearity (arch taskgeom; gpt2 and llama keep their own)"
    )
    final_norm: Annotated[bool, Strict()] = Field(
        True, description="a LayerNorm before the unembedding (false: none; arch taskgeom)"
    )

    @model_validator(mode="before")
    @classmethod
    def _hf_arch_fixes_its_parts(cls, data: Any) -> Any:
        """A Hugging Face architecture has its own positions: filled in, and a contrary setting refused
        (so one model never gets two run names). It also has its own MLP and final norm: ``activation``
        and ``final_norm``, settings of our model that a recipe gives for it, are reset to their
        defaults (so ``--set model.arch=gpt2`` on any recipe builds the same model under one name)."""
        fixed = ARCH_POSITIONS.get(data.get("arch")) if isinstance(data, dict) else None
        if fixed is None:
            return data
        if data.get("positions", fixed) != fixed:
            raise ValueError(
                f"model.arch {data['arch']} has {fixed} positions; leave model.positions out (got {data['positions']!r})"
            )
        return {key: value for key, value in data.items() if key not in ("activation", "final_norm")} | {
            "positions": fixed
        }

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.positions == "rotary" and (self.d_model // self.n_heads) % 2:
            raise ValueError("rotary positions need an even head width (model.d_model / model.n_heads)")
        return self


class TrainConfig(StrictModel):
    steps: PositiveInt = 1500
    batch_size: PositiveInt = 64
    lr: PositiveFloat = 4e-4
    weight_decay: Real = Field(4e-4, ge=0.0)
    warmup_frac: Real = Field(0.5, ge=0.0, le=1.0, description="share of steps in linear warm-up")
    schedule: Literal["triangular", "cosine"] = Field(
        "triangular", description="the decay after warm-up: linear or cosine, to lr_floor"
    )
    lr_floor: Real = Field(0.0, ge=0.0, description="the learning rate the warm-up starts from and the decay ends at")
    grad_clip: PositiveFloat | None = Field(1.0, description="the gradient norm clipped to; null: no clipping")
    seed: Int = 0
    eval_every: PositiveInt = 250
    eval_batch: PositiveInt = 256
    checkpoint_every: PositiveInt = 250
    threads: Int = Field(0, ge=0, description="torch CPU threads; 0 keeps torch's default")
    snapshots: Int = Field(0, ge=0, description="weights kept at this many log-spaced steps (snapshots/)")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16: forward passes under bfloat16 autocast")

    @field_validator("grad_clip", mode="before")
    @classmethod
    def _clip_positive_or_null(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise ValueError(
                f"train.grad_clip must be a positive gradient norm, or null for no clipping (got {value!r})"
            )
        return value

    @model_validator(mode="after")
    def _floor_below_peak(self) -> "TrainConfig":
        if self.lr_floor >= self.lr:
            raise ValueError(f"train.lr_floor ({self.lr_floor:g}) must be below the peak train.lr ({self.lr:g})")
        return self


# (section, field) of settings added after the first release; see RunConfig.digest. A task field
# counts for the families that have it (task.major_seed: dice and regression).
LATER_SETTINGS: tuple[tuple[str, str], ...] = (
    ("train", "precision"),
    ("model", "arch"),
    ("model", "activation"),
    ("model", "final_norm"),
    ("train", "schedule"),
    ("train", "lr_floor"),
    ("task", "major_seed"),
)


class RunConfig(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    task: TaskConfig
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _positions_hold_sequence(self) -> "RunConfig":
        if self.task.seq_len > self.model.max_len:
            raise ValueError(f"{self.task.length_setting()} exceeds model.max_len ({self.model.max_len})")
        return self

    @model_validator(mode="after")
    def _hf_arch_reads_tokens(self) -> "RunConfig":
        if self.model.arch != "taskgeom" and not family_class(self.task.family).reads_tokens:
            raise ValueError(
                f"model.arch {self.model.arch!r} reads tokens, but the {self.task.family} family feeds vectors; use model.arch taskgeom"
            )
        return self

    @property
    def family(self):
        """The task family (``tasks.TaskFamily``) of the task section, built anew each time."""
        return build_family(self.task)

    def digest(self) -> str:
        """Short hash of the resolved settings: names the run directory. Settings added after the
        first release (``LATER_SETTINGS``) count only when set away from their default, so run
        directories made before them keep their names."""
        data = self.model_dump(mode="json")
        for section, key in LATER_SETTINGS:
            fields = type(getattr(self, section)).model_fields
            if key in fields and getattr(getattr(self, section), key) == fields[key].default:
                del data[section][key]
        text = json.dumps(data, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def describe_value(value: Any) -> str:
    """``a list``, ``the int 5``: how a wrong YAML value is named in a message."""
    if isinstance(value, list):
        return "a list"
    return f"the {type(value).__name__} {value!r}"[:80]


def describe_validation(err: ValidationError, prefix: tuple[str, ...] = ()) -> str:
    """One line for a validation error: each problem with the dotted field it is in (under ``prefix``)."""
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in (*prefix, *item["loc"]))
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown config field {where!r}")
        elif not where or item["type"] == "value_error":  # a check of ours: its message names the fields
            lines.append(item["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"config field {where!r}: {item['msg']} (got {item.get('input')!r})")
    return "; ".join(lines)
