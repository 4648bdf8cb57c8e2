"""Validated run settings: pydantic models (unknown keys rejected, counts strictly integers, real
numbers finite), YAML recipes with profiles, dotted command-line overrides (``train.steps=200``),
and the memory a config needs (``training_memory``, ``analysis_memory``), checked against the
machine's before anything is written (``check_memory``)."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, Field, SerializeAsAny, Strict, ValidationError, field_validator, model_validator

from taskgeom.errors import EnvironmentRefused, TaskgeomError
from taskgeom.settings.fields import Int, PositiveFloat, PositiveInt, Real, StrictModel, TaskSettings
from taskgeom.tasks.registry import FamilyError, build_family, families, family_class, load_plugins, settings_model


class ConfigError(TaskgeomError, ValueError):
    """A configuration that cannot be run; the message names the field and what is allowed."""


class MemoryRefused(EnvironmentRefused):
    """A config that needs more memory than the machine has (exit code 3); the message gives the estimate."""


def _task_settings(value: Any) -> Any:
    """A ``task`` section validated by the model of the family it names (``tasks.registry``)."""
    if isinstance(value, TaskSettings):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"config field 'task' must be a mapping of settings, got {_kind(value)}")
    load_plugins()  # a plugin that fails to load: FamilyError, its message kept
    family = value.get("family")
    if family is None:
        raise ValueError(f"task.family is missing; registered families: {', '.join(sorted(families()))}")
    if not isinstance(family, str):
        raise ValueError(f"config field 'task.family' must name a family, got {_kind(family)}")
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
    positions: Literal["rotary", "learned"] = Field("rotary", description="fixed by arch for gpt2 (learned) and llama (rotary)")
    max_len: PositiveInt = 256
    arch: Literal["taskgeom", "gpt2", "llama"] = Field("taskgeom", description="gpt2, llama: a Hugging Face model (taskgeom.runs.hf)")
    activation: Literal["gelu", "silu"] = Field("gelu", description="the MLP's nonlinearity (arch taskgeom; gpt2 and llama keep their own)")
    final_norm: Annotated[bool, Strict()] = Field(True, description="a LayerNorm before the unembedding (false: none; arch taskgeom)")

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
            raise ValueError(f"model.arch {data['arch']} has {fixed} positions; leave model.positions out (got {data['positions']!r})")
        return {key: value for key, value in data.items() if key not in ("activation", "final_norm")} | {"positions": fixed}

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
    schedule: Literal["triangular", "cosine"] = Field("triangular", description="the decay after warm-up: linear or cosine, to lr_floor")
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
            raise ValueError(f"train.grad_clip must be a positive gradient norm, or null for no clipping (got {value!r})")
        return value

    @model_validator(mode="after")
    def _floor_below_peak(self) -> "TrainConfig":
        if self.lr_floor >= self.lr:
            raise ValueError(f"train.lr_floor ({self.lr_floor:g}) must be below the peak train.lr ({self.lr:g})")
        return self


# (section, field) of settings added after the first release; see RunConfig.digest. A task field
# counts for the families that have it (task.major_seed: dice and regression).
LATER_SETTINGS: tuple[tuple[str, str], ...] = (("train", "precision"), ("model", "arch"), ("model", "activation"), ("model", "final_norm"),
                                               ("train", "schedule"), ("train", "lr_floor"), ("task", "major_seed"))


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
            raise ValueError(f"model.arch {self.model.arch!r} reads tokens, but the {self.task.family} family feeds vectors; use model.arch taskgeom")
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


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.steps=200"`` -> (["train", "steps"], 200); the value is read as plain YAML (no tags)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, value = text.split("=", 1)
    try:
        if any(isinstance(token, yaml.TagToken) for token in yaml.scan(value)):
            raise ConfigError(f"override {text!r}: YAML tags (!...) are not allowed in a value; write the plain value")
        return key.strip().split("."), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({yaml_problem(err)})") from None


def yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML error: what is wrong and where (line and column, counted from 1)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


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
        raise ConfigError(describe_validation(err)) from None


DEFAULT_PROFILE = "quick"  # the profile every command reads when none is named: every recipe defines it


class MeasureSettings(StrictModel):
    """What a profile measures beside its runs' settings (a profile's ``measure:`` section, inherited
    through ``extends``): the diversity grid of the dual-mode sweep (the claims read its lowest and
    highest k) and the sizes of the study's Fig. 4 statistic (docs/protocol.md, "Projection R^2")."""

    grid: list[Int] = Field(default_factory=lambda: [-1, 3, 8], min_length=2, description="diversities k of the dual-mode sweep")
    projection_tasks: PositiveInt = Field(128, description="OOD tasks of projection R^2 (the study's 128)")
    projection_per_task: PositiveInt = Field(128, description="sequences per OOD task and per major task's mean (the study's 128)")

    @property
    def projection_sizes(self) -> tuple[int, int]:
        """(OOD tasks, sequences per task) of projection R^2."""
        return self.projection_tasks, self.projection_per_task


@dataclass(frozen=True)
class Recipe:
    """A recipe file read once (``read_recipe``): its ``base`` settings, its ``profiles`` (each with
    ``extends`` resolved, its ``measure`` section validated) and its raw ``study`` section
    (``recipes.load_study`` validates it)."""

    path: Path
    base: dict
    profiles: dict[str, dict]
    measures: dict[str, MeasureSettings]
    study: Any

    def _known(self, profile: str) -> str:
        """``profile``, or ConfigError naming the profiles the recipe defines."""
        if profile not in self.profiles:
            raise ConfigError(f"{self.path}: unknown profile {profile!r}; available: {sorted(map(str, self.profiles))}")
        return profile

    def settings(self, profile: str = DEFAULT_PROFILE) -> dict:
        """``base`` merged with ``profiles[profile]``, less its ``measure`` section."""
        settings = merge(self.base, self.profiles[self._known(profile)])
        settings.pop("measure", None)
        return settings

    def config(self, profile: str = DEFAULT_PROFILE, overrides: list[str] = ()) -> RunConfig:
        """The run config of ``profile`` with dotted ``overrides``."""
        return build_config(self.settings(profile), overrides)

    def measure(self, profile: str = DEFAULT_PROFILE) -> MeasureSettings:
        """The ``measure:`` section of ``profile`` (its defaults where the profile has none)."""
        return self.measures[self._known(profile)].model_copy(deep=True)


def read_recipe(path: str | Path) -> Recipe:
    """The recipe at ``path``, parsed and validated once per content of the file (a file written
    again is read again); ConfigError for a file that is not a recipe, naming the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    return _read_recipe(path, path.read_bytes())


@functools.lru_cache(maxsize=64)
def _read_recipe(path: Path, content: bytes) -> Recipe:
    try:
        recipe = yaml.safe_load(content.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); save the recipe as UTF-8") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({yaml_problem(err)})") from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    unknown = set(recipe) - {"base", "profiles", "study"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level keys {sorted(unknown, key=str)}; allowed: base, profiles, study")
    base, profiles = recipe.get("base") or {}, recipe.get("profiles") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: 'base' must be a mapping of settings, got {_kind(base)}")
    if not isinstance(profiles, dict):
        raise ConfigError(f"{path}: 'profiles' must be a mapping of profile names to settings, got {_kind(profiles)}")
    resolved = {str(name): _profile_settings(path, profiles, name) for name in profiles}
    measures = {}
    for name, settings in resolved.items():
        try:
            measures[name] = MeasureSettings.model_validate(settings.get("measure") or {})
        except ValidationError as err:
            raise ConfigError(f"{path}: {describe_validation(err, ('profiles', name, 'measure'))}") from None
    return Recipe(path, base, resolved, measures, recipe.get("study"))


def load_measure(path: str | Path, profile: str = DEFAULT_PROFILE) -> MeasureSettings:
    """The ``measure:`` section of ``profiles[profile]`` of the recipe at ``path`` (``MeasureSettings``;
    its defaults where the profile has none); ConfigError naming the field when it is wrong."""
    return read_recipe(path).measure(profile)


def load_config(path: str | Path, profile: str = DEFAULT_PROFILE, overrides: list[str] = ()) -> RunConfig:
    """Read a recipe: its ``base`` section merged with ``profiles[profile]`` (less its ``measure``
    section, ``load_measure``'s), then overrides (its ``study`` section is ``recipes.load_study``'s)."""
    return read_recipe(path).config(profile, overrides)


def _profile_settings(path: Path, profiles: dict, profile: str, seen: tuple[str, ...] = ()) -> dict:
    """``profiles[profile]`` with ``extends: OTHER`` resolved: OTHER's settings, then its own over them."""
    if profile not in profiles:
        raise ConfigError(f"{path}: unknown profile {profile!r}; available: {sorted(map(str, profiles))}")
    if profile in seen:
        raise ConfigError(f"{path}: profiles extend each other in a cycle: {' -> '.join([*seen, profile])}")
    settings = profiles[profile] or {}
    if not isinstance(settings, dict):
        raise ConfigError(f"{path}: profiles.{profile} must be a mapping of settings, got {_kind(settings)}")
    settings = dict(settings)
    parent = settings.pop("extends", None)
    if parent is None:
        return settings
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: profiles.{profile}.extends must name another profile, got {_kind(parent)}")
    return merge(_profile_settings(path, profiles, parent, (*seen, profile)), settings)


def _kind(value: Any) -> str:
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


# ---- memory: what a config needs, checked against the machine before anything is written --------
def parameter_count(config: RunConfig) -> int:
    """Parameters of the model of ``config``: exact for ours; within a few per cent for the Hugging
    Face ones (llama's gated MLP counted with three matrices, gpt2's biases left out)."""
    return _parameter_count(config, config.family)


def _parameter_count(config: RunConfig, family) -> int:
    """``parameter_count`` with ``config``'s family already built (a family may be costly to build)."""
    m, (n_in, n_out) = config.model, family.io_widths()
    mlp_mats = 3 if m.arch == "llama" else 2
    per_layer = 4 * m.d_model * m.d_model + mlp_mats * m.d_model * m.d_mlp + m.d_mlp + 5 * m.d_model
    positions = m.max_len * m.d_model if m.positions == "learned" else 0
    embed = n_in * m.d_model + (0 if family.reads_tokens else m.d_model)  # a Linear (with bias) for vectors
    final_norm = 2 * m.d_model if m.final_norm else 0
    return embed + positions + m.n_layers * per_layer + final_norm + m.d_model * n_out


def _pool_size(task: TaskConfig) -> int:
    from taskgeom.tasks.base import n_minor_for_diversity

    return task.n_major + n_minor_for_diversity(task.diversity)


def training_memory(config: RunConfig) -> dict[str, int]:
    """Bytes training ``config`` needs at least (a lower bound), by part: ``weights`` (fp32 parameters, gradients
    and AdamW's two moments: 16 bytes a parameter), ``activations`` (those the backward pass of one
    batch keeps, or one evaluation forward pass, whichever is larger) and ``bayes`` (the exact
    posterior over the task pool of an evaluation batch, float64)."""
    m, t, family = config.model, config.train, config.family
    T, n_out = config.task.seq_len, family.io_widths()[1]
    # per token and layer, fp32: residual, norms, q/k/v, attention output (~10 d_model) and the
    # MLP's two hidden tensors (attention scores left out: fused attention need not keep them)
    kept = 4 * (10 * m.d_model + 2 * m.d_mlp)
    train = t.batch_size * T * (m.n_layers * kept + 3 * 4 * n_out)
    evaluate = t.eval_batch * T * (kept + 2 * 8 * n_out)  # no grad: one layer at a time, float64 log-probs
    bayes = t.eval_batch * family.bayes_memory(T, _pool_size(config.task))
    return {"weights": 16 * _parameter_count(config, family), "activations": max(train, evaluate), "bayes": bayes}


def analysis_memory(config: RunConfig, n_sequences: int) -> int:
    """Bytes the M1 analysis of ``n_sequences`` sequences per batch needs at least: fp32 weights;
    the inputs and the exact Bayes quantities over the majors (``bayes_memory``) of the selection and
    measurement batches; one streamed forward pass over all sequences (attention and MLP of one layer, logits);
    the states of the measured sites with their float64 copies for the fits. A lower bound: steering
    and the fits' own work come on top."""
    m, family = config.model, config.family
    (n_in, n_out), T, K, sites = family.io_widths(), config.task.seq_len, config.task.n_major, 2
    inputs = 2 * 8 * T * (1 if family.reads_tokens else n_in)  # the two batches' inputs: int64 tokens or float64 vectors
    per_token = 4 * (m.d_mlp + 4 * m.d_model + n_out) + sites * m.d_model * (4 + 2 * 8)
    return 4 * _parameter_count(config, family) + n_sequences * (inputs + 2 * family.bayes_memory(T, K) + T * per_token)


def format_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_memory(needed: int | dict[str, int], available: int | None, where: str, what: str, advice: str) -> None:
    """MemoryRefused (exit code 3) when ``needed`` bytes (a total, or parts that add up to it) exceed
    the ``available`` bytes of ``where`` (None: unknown, nothing is checked); ``what`` names the work,
    ``advice`` the settings to reduce."""
    total = sum(needed.values()) if isinstance(needed, dict) else needed
    if available is None or total <= available:
        return
    parts = f" ({', '.join(f'{name} {format_bytes(size)}' for name, size in needed.items())})" if isinstance(needed, dict) else ""
    raise MemoryRefused(f"{what} needs at least {format_bytes(total)}{parts}, more than the {format_bytes(available)} of memory "
                        f"available on {where}; {advice}")


def check_training_memory(config: RunConfig, available: int | None, where: str, host: tuple[int | None, str] | None = None) -> None:
    """Refuse ``config`` (before its run directory is made) when training it cannot fit in the
    ``available`` bytes of ``where``. ``host``: (bytes, name) of the CPU memory when the model is on
    a GPU; the exact posterior, computed on the CPU, is checked against it."""
    need = training_memory(config)
    what = f"training {config.name} ({need['weights'] // 16:.3g} parameters)"  # 16 bytes a parameter
    advice = "reduce model.d_model, model.d_mlp, model.n_layers, task.seq_len, train.batch_size, train.eval_batch or task.diversity"
    if host is None:
        check_memory(need, available, where, what, advice)
    else:
        check_memory({"bayes": need.pop("bayes")}, host[0], host[1], what, advice)
        check_memory(need, available, where, what, advice)
