"""A small decoder-only transformer (pre-norm, rotary or learned positions) with named hook sites.
The MLP's nonlinearity (GELU or SiLU) and the final LayerNorm (or none: the unembedding reads the
residual stream) are settings of ``ModelConfig``.

Every block exposes five residual-stream sites as identity modules, so ``hooks.py`` can read or
rewrite them: ``resid_pre``, ``attn_out``, ``resid_mid = resid_pre + attn_out``, ``mlp_out`` and
``resid_post = resid_mid + mlp_out`` (``SITES``: every model of ``taskgeom.models`` has them).
Shapes: ``B`` batch, ``T`` positions, ``D`` width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from taskgeom.errors import AnalysisError
from taskgeom.settings.config import ModelConfig

SITES = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU}


class HookPoint(nn.Identity):
    """A named site in the residual stream; forward hooks on it capture or replace its value."""


class Rotary(nn.Module):
    """Rotary position embedding over half-split head dimensions: the halves (x1, x2) of a head
    become (x1 cos - x2 sin, x1 sin + x2 cos)."""

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, head_dim/2]
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)  # [max_len, head_dim]
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)  # [max_len, head_dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., T, head_dim] -> same shape, rotated by position. Computed as
        x [cos, cos] + (x2, x1) [-sin, sin]: two whole-head products instead of four half-head ones,
        and the same floats (each half is one sum of the same two rounded products)."""
        T = x.shape[-2]
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos[:T] + torch.cat([x2, x1], dim=-1) * self.sin[:T]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        head_dim = cfg.d_model // cfg.n_heads
        self.rotary = Rotary(head_dim, cfg.max_len) if cfg.positions == "rotary" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D], causal."""
        B, T, D = x.shape
        qkv = (
            self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        )  # [3, B, H, T, head_dim]
        qk, v = qkv.split(
            [2, 1]
        )  # split and unbind, not indexing: their gradients are joined without zero-filled copies
        if self.rotary is not None:
            qk = self.rotary(qk)  # queries and keys in one pass
        q, k = qk.unbind()
        y = F.scaled_dot_product_attention(q, k, v[0], is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_mlp), ACTIVATIONS[cfg.activation](), nn.Linear(cfg.d_mlp, cfg.d_model)
        )
        for site in SITES:
            setattr(self, site, HookPoint())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_mid(self.to_mid(x))

    def to_mid(self, x: torch.Tensor) -> torch.Tensor:
        """The attention half: resid_pre x: [B, T, D] -> resid_mid [B, T, D], before resid_mid's hook."""
        x = self.resid_pre(x)
        return x + self.attn_out(self.attn(self.ln_attn(x)))

    def from_mid(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half: resid_mid x: [B, T, D] (its hook and the later ones act) -> resid_post."""
        x = self.resid_mid(x)
        return self.resid_post(x + self.mlp_out(self.mlp(self.ln_mlp(x))))


class ResidualModel(nn.Module):
    """What the analysis and the hooks use of a model: ``embed_inputs(tokens) -> [B, T, D]``,
    ``blocks[l]: [B, T, D] -> [B, T, D]`` holding a HookPoint per name in ``sites``, and
    ``readout(h [..., D]) -> logits``; subclasses provide those three."""

    sites: tuple[str, ...] = SITES
    mid_sites: tuple[
        str, ...
    ] = ()  # the sites at or after resid_mid, where the blocks have ``from_mid`` (none by default)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward_from(0, self.embed_inputs(tokens))

    def forward_from(self, layer: int, x: torch.Tensor, mid: bool = False) -> torch.Tensor:
        """The rest of the forward pass from x: [B, T, D], the residual stream entering block
        ``layer`` (0..n_layers; n_layers: after the last block), or with ``mid`` its resid_mid
        before the hook (models with ``mid_sites``): blocks ``layer..`` then the readout -> logits.
        An edit at a site of block ``layer`` (with ``mid``: one of ``mid_sites``) or later still acts."""
        if mid:
            x = self.blocks[layer].from_mid(x)
            layer += 1
        for block in self.blocks[layer:]:
            x = block(x)
        return self.readout(x)

    def site(self, layer: int, name: str) -> HookPoint:
        """The hook module for ``name`` (one of ``sites``) in block ``layer``."""
        if name not in self.sites:
            raise AnalysisError(f"this model has no site {name!r}; its sites are {list(self.sites)}")
        if not 0 <= layer < len(self.blocks):
            raise AnalysisError(f"layer {layer} does not exist; the model has layers 0..{len(self.blocks) - 1}")
        return getattr(self.blocks[layer], name)


class Transformer(ResidualModel):
    """Token model ``forward(tokens [B, T] long) -> logits [B, T, n_out]`` (``vocab_size`` given), or
    vector model ``forward(inputs [B, T, d_in] float) -> outputs [B, T, n_out]`` (``d_in`` given:
    a linear read-in replaces the embedding; the blocks and hook sites are the same)."""

    mid_sites = ("resid_mid", "mlp_out", "resid_post")

    def __init__(
        self, cfg: ModelConfig, vocab_size: int | None = None, n_out: int | None = None, d_in: int | None = None
    ):
        super().__init__()
        if (vocab_size is None) == (d_in is None):
            raise ValueError("give exactly one of vocab_size (token inputs) and d_in (vector inputs)")
        if n_out is None and vocab_size is None:
            raise ValueError("a vector model needs n_out")
        self.cfg, self.vocab_size, self.d_in = cfg, vocab_size, d_in
        self.embed = nn.Embedding(vocab_size, cfg.d_model) if d_in is None else nn.Linear(d_in, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_len, cfg.d_model) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_final = nn.LayerNorm(cfg.d_model) if cfg.final_norm else nn.Identity()  # Identity: no parameters
        self.unembed = nn.Linear(cfg.d_model, n_out or vocab_size, bias=False)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2 style scaling of the residual writes
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed_inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] long (or [B, T, d_in] float for a vector model) -> resid_pre of layer 0: [B, T, D]."""
        if tokens.shape[1] > self.cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's max_len {self.cfg.max_len}")
        if self.d_in is not None and (tokens.dim() != 3 or tokens.shape[-1] != self.d_in):
            raise ValueError(f"a vector model reads inputs [B, T, {self.d_in}], got {tuple(tokens.shape)}")
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed.weight[: tokens.shape[1]]
        return x

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Final residual state [..., D] -> logits [..., n_out] (final norm, when the model has one, + unembedding)."""
        return self.unembed(self.ln_final(h))
