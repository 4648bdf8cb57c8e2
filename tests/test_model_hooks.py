"""The transformer's hook sites: residual identities, capture, intervention, clean removal."""

from __future__ import annotations

import pytest
import torch

from taskgeom.analysis.reading.states import LayerStreams
from taskgeom.errors import AnalysisError
from taskgeom.hooks import capture, intervene
from taskgeom.models import SITES, Transformer
from taskgeom.settings.config import ModelConfig


# (positions, MLP activation, final norm): the last is the study's E1/E3/E4 model (docs/protocol.md#the-studys-settings-the-paper-profile)
@pytest.fixture(params=[("rotary", "gelu", True), ("learned", "gelu", True), ("rotary", "silu", False)])
def model(request):
    torch.manual_seed(0)
    positions, activation, final_norm = request.param
    cfg = ModelConfig(
        n_layers=3,
        d_model=32,
        n_heads=4,
        d_mlp=64,
        max_len=24,
        positions=positions,
        activation=activation,
        final_norm=final_norm,
    )
    return Transformer(cfg, vocab_size=7).eval()


def test_the_mlp_activation_and_the_final_norm_are_settings():
    """SiLU in the MLP; without a final norm the unembedding reads the residual stream, and the
    model's parameters are the ones config.parameter_count counts."""
    from taskgeom.settings.recipes import build_config
    from taskgeom.training.memory import parameter_count

    for activation, final_norm in (("silu", False), ("gelu", True)):
        config = build_config(
            {
                "name": "m",
                "task": {"family": "dice", "seq_len": 8},
                "model": {
                    "n_layers": 2,
                    "d_model": 16,
                    "n_heads": 2,
                    "d_mlp": 32,
                    "max_len": 8,
                    "activation": activation,
                    "final_norm": final_norm,
                },
            }
        )
        torch.manual_seed(0)
        model = Transformer(config.model, vocab_size=6)
        assert sum(p.numel() for p in model.parameters()) == parameter_count(config)
        h = torch.randn(3, 5, 16)
        x = torch.randn(4, 16)
        mlp = model.blocks[0].mlp
        hidden = mlp[0](x)
        expected = (
            hidden * torch.sigmoid(hidden) if activation == "silu" else 0.5 * hidden * (1 + torch.erf(hidden / 2**0.5))
        )
        torch.testing.assert_close(mlp(x), mlp[2](expected))
        if final_norm:
            normed = (h - h.mean(-1, keepdim=True)) / (h.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
            torch.testing.assert_close(
                model.readout(h), normed @ model.unembed.weight.T
            )  # LayerNorm's fresh weight 1, bias 0
        else:
            assert not any(name.startswith("ln_final") for name, _ in model.named_parameters())
            torch.testing.assert_close(model.readout(h), h @ model.unembed.weight.T)


def test_residual_identities_hold_at_every_layer(model):
    tokens = torch.randint(0, 7, (5, 24))
    sites = [(layer, site) for layer in range(3) for site in SITES]
    with capture(model, sites) as states:
        logits = model(tokens)
    for layer in range(3):
        torch.testing.assert_close(
            states[(layer, "resid_mid")], states[(layer, "resid_pre")] + states[(layer, "attn_out")]
        )
        torch.testing.assert_close(
            states[(layer, "resid_post")], states[(layer, "resid_mid")] + states[(layer, "mlp_out")]
        )
        if layer:
            torch.testing.assert_close(states[(layer, "resid_pre")], states[(layer - 1, "resid_post")])
    torch.testing.assert_close(logits, model.readout(states[(2, "resid_post")]))


def test_model_is_causal(model):
    tokens = torch.randint(0, 7, (2, 24))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 7
    torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])


def test_capture_positions_and_removal(model):
    tokens = torch.randint(0, 7, (2, 24))
    with capture(model, [(1, "resid_post")], positions=slice(20, 24)) as states:
        model(tokens)
    assert states[(1, "resid_post")].shape == (2, 4, 32)
    assert all(not site._forward_hooks for block in model.blocks for site in (getattr(block, s) for s in SITES))


def test_intervention_changes_downstream_and_leaves_on_error(model):
    tokens = torch.randint(0, 7, (2, 24))
    clean = model(tokens)
    with intervene(model, (0, "resid_post"), lambda h: h + 1.0, positions=[5]):
        edited = model(tokens)
    torch.testing.assert_close(edited[:, :5], clean[:, :5])
    assert not torch.allclose(edited[:, 5:], clean[:, 5:])
    with pytest.raises(RuntimeError, match="boom"):
        with intervene(model, (1, "attn_out"), lambda h: h):
            raise RuntimeError("boom")
    torch.testing.assert_close(model(tokens), clean)


def test_intervention_shape_is_checked(model):
    with pytest.raises(ValueError, match="returned shape"):
        with intervene(model, (0, "mlp_out"), lambda h: h[:, :1]):
            model(torch.randint(0, 7, (2, 8)))


def test_unknown_sites_and_long_inputs_are_named(model):
    with pytest.raises(AnalysisError, match=r"no site 'resid'; its sites are \['resid_pre', 'attn_out'"):
        model.site(0, "resid")
    with pytest.raises(AnalysisError, match="layer 3 does not exist"):
        model.site(3, "resid_post")
    with pytest.raises(ValueError, match="exceeds the model's max_len"):
        model(torch.zeros(1, 25, dtype=torch.long))


def test_forward_from_a_layer_equals_the_whole_forward(model):
    tokens = torch.randint(0, 7, (4, 24))
    with torch.no_grad(), capture(model, [(layer, "resid_pre") for layer in range(3)] + [(2, "resid_post")]) as states:
        whole = model(tokens)
    for layer in range(3):
        assert torch.equal(model.forward_from(layer, states[(layer, "resid_pre")]), whole)
    assert torch.equal(
        model.forward_from(3, states[(2, "resid_post")]), whole
    )  # after the last block: the readout alone


def test_a_block_in_halves_is_the_block(model):
    x = torch.randn(3, 24, 32)
    block = model.blocks[1]
    with torch.no_grad():
        assert torch.equal(block.from_mid(block.to_mid(x)), block(x))
        with capture(model, [(1, "resid_mid")]) as states:
            model.forward_from(1, x)
        assert torch.equal(model.forward_from(1, states[(1, "resid_mid")], mid=True), model.forward_from(1, x))


def test_layer_streams_run_edits_from_their_layer_as_the_whole_model_does(model):
    """The kept states are unedited: an edit at any site gives the whole model's edited output, in
    any order of the calls, running from the site's block (from its resid_mid for the sites at or
    after it)."""
    tokens = torch.randint(0, 7, (4, 24))
    streams = LayerStreams(model, tokens)
    with torch.no_grad():
        assert torch.equal(streams.model_from(None)(tokens), model(tokens))
        for site in [
            (2, "resid_mid"),
            (0, "resid_pre"),
            (1, "attn_out"),
            (1, "resid_post"),
            (0, "mlp_out"),
            (1, "resid_mid"),
        ]:
            with intervene(model, site, lambda h: 0.5 * h + 1.0, positions=slice(3, 20)):
                torch.testing.assert_close(streams.model_from(site)(tokens), model(tokens), atol=1e-6, rtol=0)
    assert sorted(streams.streams) == [0, 1, 2, 3] and sorted(streams.mids) == [0, 1, 2]


def test_layer_streams_refuse_an_edited_prefix_and_other_tokens(model):
    tokens = torch.randint(0, 7, (2, 24))
    streams = LayerStreams(model, tokens)
    with intervene(model, (0, "mlp_out"), lambda h: h + 1.0):
        with pytest.raises(AnalysisError, match=r"must be unedited, but sites \[\(0, 'mlp_out'\)\]"):
            streams.model_from((2, "resid_pre"))
        streams.model_from((0, "mlp_out"))  # the edit's own block runs from its resid_mid, which the edit follows
    with intervene(model, (1, "attn_out"), lambda h: h + 1.0):
        with pytest.raises(AnalysisError, match=r"sites \[\(1, 'attn_out'\)\]"):
            streams.model_from((1, "resid_mid"))
    with pytest.raises(AnalysisError, match="other tokens"):
        streams.model_from((1, "resid_pre"))(tokens.clone())
    with pytest.raises(AnalysisError, match="layer 4 does not exist"):
        streams.entering(4)


def test_rotary_gives_the_half_split_formula_bit_for_bit():
    """Rotary's whole-head form: values and input gradients equal to the textbook
    (x1 cos - x2 sin, x1 sin + x2 cos), exactly."""
    from taskgeom.models.transformer import Rotary

    head_dim, T = 16, 12
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, T, head_dim, generator=gen)
    upstream = torch.randn(x.shape, generator=gen)
    fast, textbook = x.clone().requires_grad_(), x.clone().requires_grad_()
    x1, x2 = textbook.chunk(2, dim=-1)
    expected = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    got = Rotary(head_dim, max_len=24)(fast)
    expected.backward(upstream)
    got.backward(upstream)
    assert torch.equal(got, expected)
    assert torch.equal(fast.grad, textbook.grad)
