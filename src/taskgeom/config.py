"""Validated run settings: pydantic models (unknown keys rejected), YAML recipes with profiles,
and dotted command-line overrides (``train.steps=200``)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from taskgeom.errors import TaskgeomError
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError, model_validator


class ConfigError(TaskgeomError, ValueError):
    """A configuration that cannot be run; the message names the field and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _TaskBase(_Strict):
    n_major: PositiveInt = 3
    diversity: int = Field(-1, ge=-1, le=20, description="k: 2**k minor tasks; -1 means majors only")
    p_minor: float = Field(0.1, ge=0.0, lt=1.0)


class _TokenTaskBase(_TaskBase):
    seq_len: PositiveInt = 64


class DiceConfig(_TokenTaskBase):
    family: Literal["dice"] = "dice"
    vocab_size: int = Field(6, ge=2)
    alpha: PositiveFloat = 1.0
    majors: Literal["prior", "disjoint"] = "disjoint"
    floor: float = Field(0.02, ge=0.0)


class MarkovConfig(_TokenTaskBase):
    family: Literal["markov"] = "markov"
    vocab_size: int = Field(8, ge=2)
    alpha: PositiveFloat = 1.0


class DyckConfig(_TokenTaskBase):
    family: Literal["dyck"] = "dyck"
    n_noise: int = Field(7, ge=1)
    n_pairs: PositiveInt = 10
    p_bracket: float = Field(0.25, gt=0.0, lt=1.0)


class RegressionConfig(_TaskBase):
    """E2; its model sequence holds ``n_examples`` examples of 3 positions (``layout: separator``)
    or 2 (``layout: pair``), and ``seq_len`` is that number of positions."""

    family: Literal["regression"] = "regression"
    d: PositiveInt = 4
    n_examples: PositiveInt = 16
    noise: PositiveFloat = Field(0.5, description="noise standard deviation")
    layout: Literal["separator", "pair"] = "separator"

    @property
    def seq_len(self) -> int:
        return self.n_examples * (3 if self.layout == "separator" else 2)


TASK_CONFIGS = (DiceConfig, MarkovConfig, RegressionConfig, DyckConfig)
TaskConfig = Annotated[Union[TASK_CONFIGS], Field(discriminator="family")]
FAMILY_TAGS = {cls.model_fields["family"].default for cls in TASK_CONFIGS}


ARCH_POSITIONS = {"gpt2": "learned", "llama": "rotary"}  # the position scheme each Hugging Face architecture has


class ModelConfig(_Strict):
    n_layers: PositiveInt = 2
    d_model: PositiveInt = 64
    n_heads: PositiveInt = 2
    d_mlp: PositiveInt = 256
    positions: Literal["rotary", "learned"] = Field("rotary", description="fixed by arch for gpt2 (learned) and llama (rotary)")
    max_len: PositiveInt = 256
    arch: Literal["taskgeom", "gpt2", "llama"] = Field("taskgeom", description="gpt2, llama: a Hugging Face model (taskgeom.hf)")

    @model_validator(mode="before")
    @classmethod
    def _arch_fixes_positions(cls, data: Any) -> Any:
        """A Hugging Face architecture has its own positions: filled in, and a contrary setting refused
        (so one model never gets two run names)."""
        fixed = ARCH_POSITIONS.get(data.get("arch")) if isinstance(data, dict) else None
        if fixed is None:
            return data
        if data.get("positions", fixed) != fixed:
            raise ValueError(f"model.arch {data['arch']} has {fixed} positions; leave model.positions out (got {data['positions']!r})")
        return {**data, "positions": fixed}

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.positions == "rotary" and (self.d_model // self.n_heads) % 2:
            raise ValueError("rotary positions need an even head width (model.d_model / model.n_heads)")
        return self


class TrainConfig(_Strict):
    steps: PositiveInt = 1500
    batch_size: PositiveInt = 64
    lr: PositiveFloat = 4e-4
    weight_decay: float = Field(4e-4, ge=0.0)
    warmup_frac: float = Field(0.5, ge=0.0, le=1.0, description="share of steps in linear warm-up")
    grad_clip: PositiveFloat = 1.0
    seed: int = 0
    eval_every: PositiveInt = 250
    eval_batch: PositiveInt = 256
    checkpoint_every: PositiveInt = 250
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 keeps torch's default")
    snapshots: int = Field(0, ge=0, description="weights kept at this many log-spaced steps (snapshots/)")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16: forward passes under bfloat16 autocast")


# (section, field) of settings added after the first release; see RunConfig.digest.
LATER_SETTINGS: tuple[tuple[str, str], ...] = (("train", "precision"), ("model", "arch"))


class RunConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    task: TaskConfig
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _positions_hold_sequence(self) -> "RunConfig":
        if self.task.seq_len > self.model.max_len:
            if isinstance(self.task, RegressionConfig):
                raise ValueError(f"task.n_examples ({self.task.n_examples}) needs {self.task.seq_len} positions in the "
                                 f"{self.task.layout!r} layout, more than model.max_len ({self.model.max_len})")
            raise ValueError(f"task.seq_len ({self.task.seq_len}) exceeds model.max_len ({self.model.max_len})")
        return self

    @model_validator(mode="after")
    def _hf_arch_reads_tokens(self) -> "RunConfig":
        if self.model.arch != "taskgeom" and isinstance(self.task, RegressionConfig):
            raise ValueError(f"model.arch {self.model.arch!r} reads tokens, but the regression family feeds vectors; use model.arch taskgeom")
        return self

    def digest(self) -> str:
        """Short hash of the resolved settings: names the run directory. Settings added after the
        first release (``LATER_SETTINGS``) count only when set away from their default, so run
        directories made before them keep their names."""
        data = self.model_dump(mode="json")
        for section, key in LATER_SETTINGS:
            if getattr(getattr(self, section), key) == type(getattr(self, section)).model_fields[key].default:
                del data[section][key]
        text = json.dumps(data, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.steps=200"`` -> (["train", "steps"], 200); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(value)


def merge(base: dict, update: dict) -> dict:
    """Recursive dict merge; ``update`` wins."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def build_config(raw: dict, overrides: list[str] = ()) -> RunConfig:
    """Validate a plain dict (after dotted overrides) into a RunConfig, or raise ConfigError."""
    raw = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
        node[path[-1]] = value
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def load_config(path: str | Path, profile: str = "quick", overrides: list[str] = ()) -> RunConfig:
    """Read a recipe: its ``base`` section merged with ``profiles[profile]``, then overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        recipe = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    unknown = set(recipe) - {"base", "profiles"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level keys {sorted(unknown)}; allowed: base, profiles")
    profiles = recipe.get("profiles") or {}
    if profile not in profiles:
        raise ConfigError(f"{path}: unknown profile {profile!r}; available: {sorted(profiles)}")
    return build_config(merge(recipe.get("base") or {}, profiles[profile] or {}), overrides)


def _describe(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"] if p not in FAMILY_TAGS)
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown config field {where!r}")
        elif not where or item["type"] == "value_error":  # a check of ours: its message names the fields
            lines.append(item["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"config field {where!r}: {item['msg']} (got {item.get('input')!r})")
    return "; ".join(lines)
