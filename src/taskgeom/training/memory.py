"""The memory a run needs, checked against the machine's before anything is written: estimates of
training a config (``training_memory``, ``parameter_count``) and of its M1 analysis
(``analysis_memory``), refused with exit code 3 when they exceed what ``devices`` finds free
(``check_memory``; ``check_training_fits`` for the device a run will train on, read through
``devices`` as the CLI's own checks read it)."""

from __future__ import annotations

import torch

from taskgeom.errors import EnvironmentRefused
from taskgeom.settings import devices
from taskgeom.settings.config import RunConfig
from taskgeom.settings.fields import TaskSettings
from taskgeom.tasks.base import n_minor_for_diversity


class MemoryRefused(EnvironmentRefused):
    """A config that needs more memory than the machine has (exit code 3); the message gives the estimate."""


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


def _pool_size(task: TaskSettings) -> int:
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
    inputs = (
        2 * 8 * T * (1 if family.reads_tokens else n_in)
    )  # the two batches' inputs: int64 tokens or float64 vectors
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
    parts = (
        f" ({', '.join(f'{name} {format_bytes(size)}' for name, size in needed.items())})"
        if isinstance(needed, dict)
        else ""
    )
    raise MemoryRefused(
        f"{what} needs at least {format_bytes(total)}{parts}, more than the {format_bytes(available)} of memory "
        f"available on {where}; {advice}"
    )


def check_training_memory(
    config: RunConfig, available: int | None, where: str, host: tuple[int | None, str] | None = None
) -> None:
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


def check_training_fits(config: RunConfig, device: str) -> None:
    """Refuse ``config`` when training it on ``device`` (resolved here, as the run will
    be) cannot fit in the memory available there (EnvironmentRefused, exit 3); call it before the
    run directory is made."""
    where = devices.resolve_device(device)
    cpu = torch.device("cpu")
    host = (devices.available_memory(cpu), devices.describe(cpu)) if where.type == "cuda" else None
    check_training_memory(config, devices.available_memory(where), devices.describe(where), host)
