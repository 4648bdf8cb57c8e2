"""The transformer's hook sites: residual identities, capture, intervention, clean removal."""

from __future__ import annotations

import pytest
import torch

from taskgeom.config import ModelConfig
from taskgeom.errors import AnalysisError
from taskgeom.hooks import capture, intervene
from taskgeom.model import SITES, Transformer


@pytest.fixture(params=["rotary", "learned"])
def model(request):
    torch.manual_seed(0)
    return Transformer(ModelConfig(n_layers=3, d_model=32, n_heads=4, d_mlp=64, max_len=24, positions=request.param), vocab_size=7).eval()


def test_residual_identities_hold_at_every_layer(model):
    tokens = torch.randint(0, 7, (5, 24))
    sites = [(layer, site) for layer in range(3) for site in SITES]
    with capture(model, sites) as states:
        logits = model(tokens)
    for layer in range(3):
        torch.testing.assert_close(states[(layer, "resid_mid")], states[(layer, "resid_pre")] + states[(layer, "attn_out")])
        torch.testing.assert_close(states[(layer, "resid_post")], states[(layer, "resid_mid")] + states[(layer, "mlp_out")])
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


def test_rotary_gives_the_half_split_formula_bit_for_bit():
    """Rotary's whole-head form: values and input gradients equal to the textbook
    (x1 cos - x2 sin, x1 sin + x2 cos), exactly."""
    from taskgeom.model import Rotary

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
