"""The models taskgeom trains and analyses, in one room: our transformer (``transformer``), Hugging
Face causal LMs behind the same protocol (``hf``) and Hugging Face model directories in and out of
runs (``pretrained``). Every model has the residual-stream sites ``SITES``.

``build_model`` makes the model of a run config; it and ``model_class`` are the one place that
chooses an architecture (``model.arch``), so the run folders store and load a model without
knowing which one it is."""

from __future__ import annotations

import torch

from taskgeom.models import hf
from taskgeom.models.hf import HFCausalLM
from taskgeom.models.transformer import SITES, ResidualModel, Transformer
from taskgeom.rng import fold_seed
from taskgeom.settings.config import ModelConfig, RunConfig
from taskgeom.tasks.base import TaskFamily


def model_class(cfg: ModelConfig) -> type[ResidualModel]:
    """The class of the model ``cfg`` describes: ours for model.arch taskgeom, the Hugging Face
    adapter for gpt2 and llama. Its ``sites`` are known without building a model."""
    return Transformer if cfg.arch == "taskgeom" else HFCausalLM


def build_model(config: RunConfig, family: TaskFamily) -> ResidualModel:
    """A freshly initialised model of ``config`` reading and writing what its ``family`` (the
    config's, built once by the caller) feeds and predicts: ours, or for model.arch gpt2 / llama the
    Hugging Face one behind ``HFCausalLM``. Its weights depend on ``train.seed`` alone."""
    torch.manual_seed(fold_seed(config.train.seed, 0, "init"))
    if model_class(config.model) is HFCausalLM:
        return hf.build(config.model, **family.model_io())
    return Transformer(config.model, **family.model_io())


__all__ = ["SITES", "HFCausalLM", "ResidualModel", "Transformer", "build_model", "model_class"]
