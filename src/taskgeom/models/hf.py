"""Hugging Face causal language models (GPT-2, Llama) behind taskgeom's model protocol.

``HFCausalLM`` wraps a ``transformers`` causal LM so that the analysis, the hooks and the trainer
use it like our ``Transformer``: ``forward(tokens [B, T]) -> logits [B, T, V]``,
``embed_inputs(tokens) -> [B, T, D]``, ``blocks[l]: [B, T, D] -> [B, T, D]``, ``readout(h)`` and
``site(layer, name)``. Its sites are those of our model, with the same identities:
``resid_pre``, ``attn_out``, ``resid_mid = resid_pre + attn_out``, ``mlp_out`` and
``resid_post = resid_mid + mlp_out``. ``resid_mid`` lives inside one call of an HF decoder layer, so
it is formed in the hook on the layer's attention and edited through that module's output.

``build`` makes the HF model of a run with ``model.arch`` gpt2 or llama (no download; called by
``taskgeom.models.build_model``) and ``model_config`` describes a supported HF config as a
``ModelConfig``; ``taskgeom.models.pretrained`` writes and reads such models as Hugging Face model
directories. ``transformers`` is imported only when a model is built or loaded (``pip install
taskgeom[hf]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from taskgeom.errors import TaskgeomError
from taskgeom.models.transformer import SITES, HookPoint, ResidualModel
from taskgeom.settings.config import ConfigError, ModelConfig

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")  # those that take an additive [1, 1, T, T] mask


@dataclass(frozen=True)
class Layout:
    """Where an architecture keeps its parts: attribute names in the base model (``layers``,
    ``final_norm``, ``learned_positions`` or ``rotary``) and in each decoder layer (``attention``,
    whose first output is attn_out, ``mlp``, and ``input_norm``, the LayerNorm that reads the
    layer's input); ``d_mlp`` reads the MLP width off the HF config."""

    layers: str
    final_norm: str
    attention: str
    mlp: str
    input_norm: str
    d_mlp: Callable[[object], int]
    learned_positions: str | None = None
    rotary: str | None = None


LAYOUTS = {
    "gpt2": Layout(
        "h", "ln_f", "attn", "mlp", "ln_1", lambda c: c.n_inner or 4 * c.hidden_size, learned_positions="wpe"
    ),
    "llama": Layout(
        "layers", "norm", "self_attn", "mlp", "input_layernorm", lambda c: c.intermediate_size, rotary="rotary_emb"
    ),
}
SUPPORTED = tuple(LAYOUTS)


def layout(model_type: str | None) -> Layout:
    """The layout of a supported ``config.model_type``; TaskgeomError naming the supported ones."""
    if model_type not in LAYOUTS:
        raise TaskgeomError(
            f"model type {model_type!r} is not supported; taskgeom analyses the Hugging Face architectures {list(SUPPORTED)}"
        )
    return LAYOUTS[model_type]


def require_transformers():
    """The transformers module; TaskgeomError naming the extra when it is not installed."""
    try:
        import transformers
    except ImportError:
        raise TaskgeomError("Hugging Face models need the transformers package: pip install 'taskgeom[hf]'") from None
    return transformers


def causal_mask(T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, T, T] additive mask: 0 on and below the diagonal, the dtype's minimum above it.

    Passed explicitly because HF layers called without one attend causally only under sdpa
    (eager attention then sees the whole sequence)."""
    return torch.full((T, T), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)[None, None]


def _through(point: HookPoint) -> Callable:
    """A forward hook that routes a submodule's output (or the first item of its tuple) through ``point``."""

    def hook(_module, _inputs, output):
        if isinstance(output, tuple):
            return (point(output[0]), *output[1:])
        return point(output)

    return hook


class DecoderBlock(nn.Module):
    """One HF decoder layer as a causal map ``x [B, T, D] -> [B, T, D]`` with hook sites: resid_pre
    and resid_post around the layer, attn_out and mlp_out on the outputs of its attention and MLP,
    and resid_mid = resid_pre + attn_out, formed in the attention's hook.

    The layer adds its attention's output to its input itself, so resid_mid is rewritten through
    attn_out: an edit ``mid -> mid'`` adds ``mid' - mid`` to the attention's output, and the layer's
    own sum then is ``mid'`` (up to rounding); unhooked, the change is exactly zero. The hook knows
    resid_pre because ``forward`` keeps it (``stream``) while the layer runs; calling the HF model
    directly, not through ``forward``, passes resid_mid over, as it does resid_pre and resid_post.

    The layer (and the rotary module) belong to the wrapped model, which holds their weights, so they
    are kept here without being registered: the state dict names every weight once."""

    def __init__(self, layer: nn.Module, parts: Layout, rotary: nn.Module | None):
        super().__init__()
        for site in SITES:
            setattr(self, site, HookPoint())
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "rotary", rotary)
        object.__setattr__(
            self, "ln_attn", getattr(layer, parts.input_norm)
        )  # the norm reading the block's input, as the transformer's
        self.stream: torch.Tensor | None = None  # resid_pre [B, T, D] while the layer runs under forward
        getattr(layer, parts.attention).register_forward_hook(self._attention)
        getattr(layer, parts.mlp).register_forward_hook(_through(self.mlp_out))

    def _attention(self, _module, _inputs, output):
        """Forward hook on the attention: its output [B, T, D] (or the first item of its tuple)
        through attn_out, then resid_mid's change added to it."""
        rest = output[1:] if isinstance(output, tuple) else None
        write = self.attn_out(output[0] if rest is not None else output)
        if self.stream is not None:
            mid = self.stream + write
            write = write + (self.resid_mid(mid) - mid)
        return write if rest is None else (write, *rest)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resid_pre(x)
        T = x.shape[1]
        inputs = {"attention_mask": causal_mask(T, x.dtype, x.device)}
        if self.rotary is not None:
            positions = torch.arange(T, device=x.device)[None]
            inputs |= {"position_ids": positions, "position_embeddings": self.rotary(x, positions)}
        self.stream = x
        try:
            out = self.layer(x, **inputs)
        finally:
            self.stream = None
        return self.resid_post(out[0] if isinstance(out, tuple) else out)


class HFCausalLM(ResidualModel):
    """A ``transformers`` GPT-2 or Llama causal LM (``model``) with taskgeom's model protocol.

    ``n_out``: keep only the first ``n_out`` logits (a task's tokens, when the model's vocabulary is
    larger); None keeps all. The weights stay in ``self.hf`` (state dict keys ``hf.<HF name>``).
    Wrapping adds forward hooks to the model's attention and MLP modules that pass their outputs
    through the attn_out / resid_mid / mlp_out sites (identity unless those sites are hooked).
    Embedding dropout is not applied: models built here have no dropout, and analysis runs in eval mode.
    """

    sites = SITES

    def __init__(self, model: nn.Module, n_out: int | None = None):
        super().__init__()
        config = model.config
        self.parts = layout(getattr(config, "model_type", None))
        attention = getattr(config, "_attn_implementation", None) or "eager"
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise TaskgeomError(
                f"attention implementation {attention!r} is not supported; load the model with "
                f"attn_implementation one of {list(ATTENTION_IMPLEMENTATIONS)}"
            )
        self.hf, self.n_out = model, n_out
        self.model_type, self.vocab_size, self.max_len = (
            config.model_type,
            config.vocab_size,
            config.max_position_embeddings,
        )
        base = model.base_model
        rotary = getattr(base, self.parts.rotary) if self.parts.rotary else None
        self.blocks = nn.ModuleList(
            DecoderBlock(layer, self.parts, rotary) for layer in getattr(base, self.parts.layers)
        )

    def embed_inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] long -> resid_pre of layer 0: [B, T, D] (token, plus learned position, embeddings)."""
        T = tokens.shape[1]
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds the model's {self.max_len} positions")
        x = self.hf.get_input_embeddings()(tokens)
        if self.parts.learned_positions:
            x = x + getattr(self.hf.base_model, self.parts.learned_positions)(torch.arange(T, device=tokens.device))
        return x

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Final residual state [..., D] -> logits [..., n_out or V] (final norm + LM head)."""
        logits = self.hf.get_output_embeddings()(getattr(self.hf.base_model, self.parts.final_norm)(h))
        return logits if self.n_out is None else logits[..., : self.n_out]


# ---- models of runs with model.arch gpt2 / llama ---------------------------------------------
def hf_config(cfg: ModelConfig, vocab_size: int):
    """The transformers config of ``cfg`` (arch gpt2 or llama): no dropout, untied unembedding."""
    transformers = require_transformers()
    common = {"vocab_size": vocab_size, "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None}
    if cfg.arch == "gpt2":
        return transformers.GPT2Config(
            n_positions=cfg.max_len,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_inner=cfg.d_mlp,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    if cfg.arch == "llama":
        return transformers.LlamaConfig(
            hidden_size=cfg.d_model,
            intermediate_size=cfg.d_mlp,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_heads,
            max_position_embeddings=cfg.max_len,
            attention_dropout=0.0,
            pad_token_id=None,
            **common,
        )
    raise ConfigError(f"model.arch {cfg.arch!r} is not a Hugging Face architecture; choose one of {list(SUPPORTED)}")


def build(cfg: ModelConfig, vocab_size: int) -> HFCausalLM:
    """A freshly initialised HF model for ``cfg``, wrapped; its weights follow torch's global seed."""
    return HFCausalLM(require_transformers().AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size)))


def model_config(config) -> ModelConfig:
    """The ModelConfig describing a supported HF config (sizes, positions, arch)."""
    parts = layout(getattr(config, "model_type", None))
    return ModelConfig(
        n_layers=config.num_hidden_layers,
        d_model=config.hidden_size,
        n_heads=config.num_attention_heads,
        d_mlp=parts.d_mlp(config),
        positions="rotary" if parts.rotary else "learned",
        max_len=config.max_position_embeddings,
        arch=config.model_type,
    )
