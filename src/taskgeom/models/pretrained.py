"""Hugging Face model directories in and out of runs.

``save_pretrained`` writes the model of a run with ``model.arch`` gpt2 or llama (or an
``hf.HFCausalLM``) as a directory ``from_pretrained`` loads, and ``open_pretrained`` turns such a
directory plus a recipe into a finished run (``PretrainedRun``) for the analysis. It reads and
makes runs, so it sits above the run folders (``runs/``), the one module of ``models/`` that does.
"""

from __future__ import annotations

from pathlib import Path

from taskgeom.errors import RunDirError, TaskgeomError
from taskgeom.models.hf import SUPPORTED, HFCausalLM, model_config, require_transformers
from taskgeom.runs.folders import Run
from taskgeom.settings.config import ConfigError, RunConfig
from taskgeom.settings.recipes import DEFAULT_PROFILE, load_recipe
from taskgeom.tasks.registry import family_class


def save_pretrained(source: Run | HFCausalLM, out: Path | str) -> Path:
    """Write the HF model of a finished run (model.arch gpt2 or llama), or of an adapter, to ``out``
    (config.json, model.safetensors) for ``AutoModelForCausalLM.from_pretrained``; returns ``out``.
    ``out`` must be new or empty, so nothing already written (a run directory, say) is replaced."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TaskgeomError(
            f"{out} already exists and is not an empty folder; choose a new folder for the Hugging Face model"
        )
    model = source.load_model() if isinstance(source, Run) else source
    if not isinstance(model, HFCausalLM):
        raise TaskgeomError(
            f"only models of model.arch {list(SUPPORTED)} are Hugging Face models; this one is taskgeom's own "
            "(train with --set model.arch=gpt2 to get one)"
        )
    model.hf.save_pretrained(str(out))
    return out


# ---- analysing a directory written by save_pretrained ------------------------------------------
class PretrainedRun(Run):
    """A Hugging Face model directory (``source``) seen as a finished run: task and seeds from a
    recipe, the model section from the directory's config.json; analysis output under ``path``."""

    def __init__(self, source: Path, config: RunConfig, path: Path):
        super().__init__(path, config)
        self.source = Path(source)

    @property
    def finished(self) -> bool:
        return True

    def load_model(self) -> HFCausalLM:
        """The adapter over ``AutoModelForCausalLM.from_pretrained(source)`` in float32, its logits cut to the task's tokens."""
        try:
            model = require_transformers().AutoModelForCausalLM.from_pretrained(str(self.source)).float()
        except OSError as err:  # no or unreadable weights beside config.json
            raise RunDirError(f"{self.source}: the Hugging Face model cannot be loaded ({err})") from None
        return HFCausalLM(model, n_out=self.family.vocab_size).eval()


def open_pretrained(
    source: Path | str,
    recipe: str | None,
    profile: str = DEFAULT_PROFILE,
    overrides: list[str] = (),
    out: Path | str | None = None,
) -> PretrainedRun:
    """The HF model directory ``source`` with the task of ``recipe`` (profile, dotted overrides; its
    model section is replaced by the directory's); analysis output goes to ``out`` (default
    ``source/taskgeom``). TaskgeomError when the directory, its architecture or its sizes do not fit."""
    source = Path(source)
    if (source / "run.json").is_file():
        raise RunDirError(f"{source} is a taskgeom run directory: analyse it without --recipe")
    if not (source / "config.json").is_file():
        raise RunDirError(
            f"{source} is neither a taskgeom run directory nor a Hugging Face model directory (no config.json)"
        )
    if recipe is None:
        raise TaskgeomError(
            f"{source} is a Hugging Face model directory: name the recipe of the task it was trained on with --recipe"
        )
    transformers = require_transformers()
    try:
        hf = transformers.AutoConfig.from_pretrained(str(source))
    except (OSError, ValueError) as err:
        raise RunDirError(f"{source}/config.json cannot be read by transformers ({err})") from None
    model = model_config(hf)
    config = load_recipe(recipe, profile, list(overrides))
    if not family_class(config.task.family).reads_tokens:
        raise ConfigError(
            f"a Hugging Face causal LM reads tokens, but the recipe's family {config.task.family!r} feeds vectors"
        )
    if config.task.seq_len > model.max_len:
        raise ConfigError(
            f"the task's sequences have {config.task.seq_len} positions; the model at {source} has {model.max_len}"
        )
    run = PretrainedRun(
        source, config.model_copy(update={"model": model}), Path(out) if out is not None else source / "taskgeom"
    )
    if run.family.vocab_size > hf.vocab_size:
        raise ConfigError(
            f"the task has {run.family.vocab_size} tokens; the model at {source} has a vocabulary of {hf.vocab_size}"
        )
    return run
