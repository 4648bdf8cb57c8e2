"""The Hugging Face adapter: logits and hidden states equal the HF model's own, interventions act as
re-running the later blocks predicts, and a GPT-2 trained on E1 by our trainer, saved with
save_pretrained and loaded back, gives the M1 analysis of the run it came from."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from taskgeom.analysis.reading.states import LayerStreams  # noqa: E402
from taskgeom.analysis.stored.m1 import analyze, check_request  # noqa: E402
from taskgeom.analysis.study import StudyRun, open_run  # noqa: E402
from taskgeom.cli import app  # noqa: E402
from taskgeom.errors import AnalysisError, TaskgeomError  # noqa: E402
from taskgeom.hooks import capture, intervene  # noqa: E402
from taskgeom.models import (
    hf,  # noqa: E402
    pretrained,  # noqa: E402
)
from taskgeom.runs.folders import Run  # noqa: E402
from taskgeom.settings.config import ConfigError, ModelConfig  # noqa: E402
from taskgeom.settings.recipes import (
    build_config,  # noqa: E402
    load_recipe,  # noqa: E402
)
from taskgeom.training.train import train  # noqa: E402

SMALL = ModelConfig(n_layers=3, d_model=32, n_heads=2, d_mlp=64, max_len=16)
# the task settings the round-trip model is trained on: E1's variant e1-v6 (V = 6, near-disjoint majors), whose geometry
# 200 steps of a tiny GPT-2 reach (the recipe's V = 16 is the study's setting, docs/protocol.md#the-studys-settings-the-paper-profile)
TASK = ["task.seq_len=24", "train.seed=0", "task.vocab_size=6", "task.majors=disjoint"]
TRAIN = TASK + [
    "model.max_len=24",
    "model.d_model=32",
    "model.d_mlp=64",
    "model.arch=gpt2",
    "train.steps=200",
    "train.batch_size=32",
    "train.lr=3e-3",
    "train.eval_every=200",
    "train.checkpoint_every=200",
    "train.eval_batch=64",
    "train.snapshots=2",
    "train.threads=1",
]
N_SEQUENCES = 96


def hf_model(arch: str, attention: str, vocab: int = 7) -> torch.nn.Module:
    torch.manual_seed(0)
    config = hf.hf_config(SMALL.model_copy(update={"arch": arch}), vocab)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


@pytest.fixture(params=[("gpt2", "sdpa"), ("gpt2", "eager"), ("llama", "sdpa"), ("llama", "eager")], ids="-".join)
def pair(request):
    model = hf_model(*request.param)
    return model, hf.HFCausalLM(model).eval()


def test_adapter_logits_and_states_equal_the_hf_models_own(pair):
    """Logits equal HF's forward (which builds its own causal mask; eager attention included, where
    calling a layer without a mask would not be causal). HF's hidden_states[l + 1] is resid_post of
    layer l for all but the last layer; its last entry has the final norm applied, so it is compared
    with the final norm of the last resid_post."""
    model, adapter = pair
    tokens = torch.randint(0, 7, (4, 16), generator=torch.Generator().manual_seed(1))
    n_layers = len(adapter.blocks)
    with capture(adapter, [(layer, site) for layer in range(n_layers) for site in hf.SITES]) as states:
        logits = adapter(tokens)
    with torch.no_grad():
        theirs = model(tokens, output_hidden_states=True)
    torch.testing.assert_close(logits, theirs.logits, atol=1e-5, rtol=0)
    hidden = theirs.hidden_states
    assert len(hidden) == n_layers + 1
    torch.testing.assert_close(states[(0, "resid_pre")], hidden[0], atol=1e-6, rtol=0)
    for layer in range(n_layers - 1):
        torch.testing.assert_close(states[(layer, "resid_post")], hidden[layer + 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(states[(layer + 1, "resid_pre")], states[(layer, "resid_post")])
    final_norm = getattr(model.base_model, adapter.parts.final_norm)
    torch.testing.assert_close(final_norm(states[(n_layers - 1, "resid_post")]), hidden[-1], atol=1e-5, rtol=0)
    for layer in range(n_layers):  # attn_out and mlp_out are the residual writes of the HF submodules
        writes = states[(layer, "resid_pre")] + states[(layer, "attn_out")] + states[(layer, "mlp_out")]
        torch.testing.assert_close(states[(layer, "resid_post")], writes, atol=1e-5, rtol=0)


def test_adapter_is_causal(pair):
    _, adapter = pair
    tokens = torch.randint(0, 7, (2, 16), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 7
    with torch.no_grad():
        torch.testing.assert_close(adapter(tokens)[:, :9], adapter(changed)[:, :9])
        assert not torch.allclose(adapter(tokens)[:, 9:], adapter(changed)[:, 9:])


@torch.no_grad()
def test_intervention_equals_rerunning_the_later_blocks_by_hand(pair):
    _, adapter = pair
    tokens = torch.randint(0, 7, (3, 16), generator=torch.Generator().manual_seed(3))
    shift = torch.randn(32, generator=torch.Generator().manual_seed(4))
    edit, positions = (lambda h: 2.0 * h + shift), slice(6, None)
    clean = adapter(tokens)
    for site in [(0, "resid_post"), (1, "resid_pre")]:
        with capture(adapter, [site]) as states:
            adapter(tokens)
        x = states[site].clone()
        x[:, positions] = edit(x[:, positions])
        for block in adapter.blocks[1:]:
            x = block(x)
        with intervene(adapter, site, edit, positions):
            edited = adapter(tokens)
        torch.testing.assert_close(edited, adapter.readout(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(edited[:, :6], clean[:, :6])
        assert (edited[:, 6:] - clean[:, 6:]).abs().max() > 1e-2
    torch.testing.assert_close(adapter(tokens), clean)  # the hooks left with their blocks

    # attn_out is what the layer adds to the stream: the edited write is what resid_post receives
    with (
        capture(adapter, [(1, s) for s in hf.SITES]) as states,
        intervene(adapter, (1, "attn_out"), lambda h: h + shift, positions),
    ):
        adapter(tokens)
    with capture(adapter, [(1, "attn_out")]) as unedited:
        adapter(tokens)
    write = states[(1, "resid_post")] - states[(1, "resid_pre")] - states[(1, "mlp_out")]
    expected = unedited[(1, "attn_out")].clone()
    expected[:, positions] += shift
    torch.testing.assert_close(write, expected, atol=1e-5, rtol=0)


def test_sites_the_adapter_lacks_are_clear_errors(pair):
    _, adapter = pair
    with pytest.raises(
        AnalysisError,
        match=r"no site 'mlp_in'; its sites are \['resid_pre', 'attn_out', 'resid_mid', 'mlp_out', 'resid_post'\]",
    ):
        adapter.site(0, "mlp_in")
    with pytest.raises(AnalysisError, match="layer 3 does not exist"):
        adapter.site(3, "resid_post")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    config = transformers.BertConfig(
        vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    model = transformers.BertForMaskedLM(config)
    with pytest.raises(TaskgeomError, match=r"model type 'bert' is not supported; .* \['gpt2', 'llama'\]"):
        hf.HFCausalLM(model)
    model.save_pretrained(str(tmp_path / "bert"))
    result = CliRunner().invoke(app, ["analyze", str(tmp_path / "bert"), "--recipe", "e1"])
    assert result.exit_code == 2
    assert "model type 'bert' is not supported" in result.output and "['gpt2', 'llama']" in result.output
    assert not (tmp_path / "bert" / "taskgeom").exists()


def test_hf_arch_runs_build_seeded_models_and_need_token_families():
    run = Run("unused", load_recipe("e1", "quick", TRAIN))
    a, b = run.new_model(), run.new_model()
    assert isinstance(a, hf.HFCausalLM) and a.model_type == "gpt2" and len(a.blocks) == 2
    assert run.sites == a.sites == hf.SITES
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = Run("unused", load_recipe("e1", "quick", TRAIN + ["train.seed=1"])).new_model()
    assert not torch.equal(
        a.state_dict()["hf.transformer.h.0.attn.c_attn.weight"],
        other.state_dict()["hf.transformer.h.0.attn.c_attn.weight"],
    )
    llama = Run("unused", load_recipe("e3", "quick", ["model.arch=llama", "model.d_model=32"])).new_model()
    assert llama.model_type == "llama" and llama.hf.config.hidden_size == 32 and llama.vocab_size == 8
    with pytest.raises(ConfigError, match="model.arch 'gpt2' reads tokens, but the regression family feeds vectors"):
        build_config({"name": "e2", "task": {"family": "regression"}, "model": {"arch": "gpt2"}})
    with pytest.raises(AnalysisError, match=r"unknown sites \['mlp_in'\]; this model has"):
        check_request(StudyRun(run), sites=("mlp_in", "resid_post"))
    assert {place.site for place in check_request(StudyRun(run))} == {"resid_mid", "resid_post"}


@pytest.mark.parametrize("arch, norm", [("gpt2", "ln_1"), ("llama", "input_layernorm")])
def test_e3_p2_reads_the_states_after_the_next_layers_input_norm(tmp_path, arch, norm):
    """E3's P2 passes resid_post of a block through the LayerNorm that reads the next block's input
    (the study's post_layernorm=True); on an HF model that norm is the next decoder layer's own."""
    from taskgeom.hooks import Place

    created = Run.create(
        load_recipe(
            "e3",
            "quick",
            [f"model.arch={arch}", "model.d_model=32", "model.d_mlp=64", "task.seq_len=24", "model.max_len=24"],
        ),
        tmp_path,
    )
    run = StudyRun(created, created.new_model().eval())  # an untrained model: the norm is what is checked
    major = run.heldout("major", 48, split="measure")
    place = Place(0, "resid_post")
    geometry = run.geometry(major, place)
    additive = geometry.p2_additive
    assert additive.post_layernorm and run.model.blocks[1].ln_attn is getattr(run.model.blocks[1].layer, norm)
    with torch.no_grad():
        normed = run.model.blocks[1].ln_attn(geometry.states)
    # the same fit on the normalised states, at a site where P2 normalises nothing
    by_hand = type(geometry)(run, Place(0, "resid_mid"), major, normed, geometry.window, geometry.n_random).p2_additive
    torch.testing.assert_close(additive.by_position, by_hand.by_position, rtol=0, atol=0)


# ---- resid_mid: formed inside the HF layer, edited through attn_out ------------------------------
MLP_NORM = {"gpt2": "ln_2", "llama": "post_attention_layernorm"}  # the norm before each layer's MLP


def test_resid_mid_obeys_the_site_identities(pair):
    _, adapter = pair
    tokens = torch.randint(0, 7, (4, 16), generator=torch.Generator().manual_seed(5))
    with capture(adapter, [(layer, site) for layer in range(len(adapter.blocks)) for site in hf.SITES]) as states:
        adapter(tokens)
    for layer in range(len(adapter.blocks)):
        mid = states[(layer, "resid_mid")]
        assert (mid - states[(layer, "resid_pre")]).abs().max() > 1e-3  # attention writes something
        torch.testing.assert_close(mid, states[(layer, "resid_pre")] + states[(layer, "attn_out")], atol=1e-6, rtol=0)
        torch.testing.assert_close(states[(layer, "resid_post")], mid + states[(layer, "mlp_out")], atol=1e-6, rtol=0)


def _edits() -> dict:
    shift = torch.randn(32, generator=torch.Generator().manual_seed(6))
    u = torch.randn(32, generator=torch.Generator().manual_seed(7))
    u = u / u.norm()
    return {"shift": lambda h: h + shift, "project_out": lambda h: h - (h @ u)[..., None] * u}


@torch.no_grad()
@pytest.mark.parametrize("edit_name", ["shift", "project_out"])
@pytest.mark.parametrize("positions", [slice(6, None), [2, 9, 10]], ids=["from6", "some"])
def test_resid_mid_intervention_is_an_edit_of_the_true_resid_mid(pair, edit_name, positions):
    """Editing resid_mid of layer 1 gives the model in which the layer's MLP reads the edited state
    and adds to it (run by hand from the HF layer's own norm and MLP, then the later blocks), and the
    same logits as adding the change at attn_out; resid_post = edited resid_mid + mlp_out."""
    model, adapter = pair
    edit = _edits()[edit_name]
    tokens = torch.randint(0, 7, (3, 16), generator=torch.Generator().manual_seed(8))
    clean = adapter(tokens)
    with capture(adapter, [(1, "resid_mid")]) as states:
        adapter(tokens)
    mid = states[(1, "resid_mid")]
    edited_mid = mid.clone()
    edited_mid[:, positions] = edit(mid[:, positions])

    layer = adapter.blocks[1].layer
    x = edited_mid + getattr(layer, adapter.parts.mlp)(getattr(layer, MLP_NORM[adapter.model_type])(edited_mid))
    for block in adapter.blocks[2:]:
        x = block(x)
    by_hand = adapter.readout(x)

    with intervene(adapter, (1, "resid_mid"), edit, positions), capture(adapter, [(1, s) for s in hf.SITES]) as after:
        edited = adapter(tokens)
    change = edited_mid - mid
    with intervene(adapter, (1, "attn_out"), lambda a: a + change[:, positions], positions):
        through_attn_out = adapter(tokens)

    assert (edited - clean).abs().max() > 1e-2
    torch.testing.assert_close(edited, by_hand, atol=1e-5, rtol=0)
    torch.testing.assert_close(edited, through_attn_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(after[(1, "resid_mid")], edited_mid, atol=1e-6, rtol=0)
    torch.testing.assert_close(after[(1, "resid_post")], edited_mid + after[(1, "mlp_out")], atol=1e-5, rtol=0)
    torch.testing.assert_close(adapter(tokens), clean)  # the hooks left with the block


@torch.no_grad()
def test_resid_mid_edit_changes_only_its_positions_and_later(pair):
    _, adapter = pair
    tokens = torch.randint(0, 7, (2, 16), generator=torch.Generator().manual_seed(9))
    shift = torch.randn(32, generator=torch.Generator().manual_seed(10))
    for layer in range(len(adapter.blocks)):
        with capture(adapter, [(layer, "resid_pre"), (layer, "resid_post")]) as clean:
            logits = adapter(tokens)
        with (
            intervene(adapter, (layer, "resid_mid"), lambda h: h + shift, [7, 11]),
            capture(adapter, [(layer, "resid_pre"), (layer, "resid_post")]) as edited,
        ):
            changed = adapter(tokens)
        torch.testing.assert_close(edited[(layer, "resid_pre")], clean[(layer, "resid_pre")], atol=0, rtol=0)
        torch.testing.assert_close(changed[:, :7], logits[:, :7], atol=0, rtol=0)
        torch.testing.assert_close(
            edited[(layer, "resid_post")][:, :7], clean[(layer, "resid_post")][:, :7], atol=0, rtol=0
        )
        assert (changed[:, 7] - logits[:, 7]).abs().max() > 1e-3
        assert (edited[(layer, "resid_post")][:, 11] - clean[(layer, "resid_post")][:, 11]).abs().max() > 1e-2


# ---- round trip: our trainer -> save_pretrained -> from_pretrained -> M1 analysis ----------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Run:
    run = Run.create(load_recipe("e1", "quick", TRAIN), tmp_path_factory.mktemp("runs"))
    train(run)
    return run


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "e1-gpt2"
    result = CliRunner().invoke(app, ["export-hf", str(trained.path), str(out)])
    assert result.exit_code == 0, result.output
    return out


def _table(rows: list[dict]) -> pd.DataFrame:
    keys = ["layer", "site", "metric", "position", "task"]
    return pd.DataFrame(rows).fillna({"position": -1, "task": -1}).set_index(keys).sort_index()


def test_exported_model_loads_with_from_pretrained_and_keeps_the_weights(trained, exported):
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    ours = trained.load_model()
    tokens = trained.family.sample(trained.pool, 8, 24, 5, 0, "check").tokens
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, ours(tokens), atol=1e-6, rtol=0)
    assert sorted(trained.snapshots()) == [10, 200]  # snapshots go through the same state dict


def test_m1_of_the_loaded_copy_equals_the_runs_own(trained, exported):
    own = analyze(StudyRun(trained), n_sequences=N_SEQUENCES)
    result = CliRunner().invoke(
        app,
        [
            "analyze",
            str(exported),
            "--recipe",
            "e1",
            *sum((["--set", s] for s in TASK), []),
            "--sequences",
            str(N_SEQUENCES),
        ],
    )
    assert result.exit_code == 0, result.output
    table = pd.read_json(exported / "taskgeom" / "analysis" / "m1.json")
    assert set(table["site"]) == {"resid_mid", "resid_post"}
    for name in ("simplex", "layers", "steering"):
        assert (exported / "taskgeom" / "figures" / f"m1_{name}.png").stat().st_size > 10_000
    api = analyze(open_run(exported, "e1", overrides=TASK), n_sequences=N_SEQUENCES)
    expected = _table(own.rows)
    for rows in (table.to_dict("records"), api.rows):
        got = _table(rows)
        assert got.index.equals(expected.index)
        torch.testing.assert_close(
            torch.tensor(got["value"].to_numpy()),
            torch.tensor(expected["value"].to_numpy()),
            atol=1e-5,
            rtol=1e-4,
            equal_nan=True,
        )  # n/a rows are NaN in both
    assert (api.place, api.p3_place, api.selected) == (own.place, own.p3_place, own.selected)


def test_the_tiny_gpt2_has_the_m1_geometry(trained):
    """Not a tautology of the round trip: 200 steps of our trainer give a GPT-2 whose late states
    are task + token cells (P0, P1), lie on the task simplex (P2, P3) and steer (ratio >= 3)."""
    from taskgeom.claims.m1 import claims

    result = analyze(StudyRun(trained), n_sequences=N_SEQUENCES)
    passed = {c.id: c.passed for c in claims(result)}
    assert result.summary["p0.within_share"] < 0.01
    assert all(passed[f"e1.{name}"] for name in ("P0", "P1", "P2", "P2.vs_random", "P3", "steering")), passed


def test_plain_analyze_of_a_gpt2_run_directory(trained):
    result = CliRunner().invoke(app, ["analyze", str(trained.path), "--sequences", "48", "--layer", "1"])
    assert result.exit_code == 0, result.output
    table = pd.read_json(trained.path / "analysis" / "m1.json")
    assert set(zip(table["layer"], table["site"])) == {(1, "resid_mid"), (1, "resid_post")}


def test_larger_vocabulary_is_cut_to_the_tasks_tokens(tmp_path):
    torch.manual_seed(0)
    adapter = hf.build(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_mlp=32, max_len=32, arch="llama"), 20)
    pretrained.save_pretrained(adapter, tmp_path / "wide")
    run = pretrained.open_pretrained(tmp_path / "wide", "e1", overrides=["task.seq_len=32"])  # E1's 16 faces
    assert run.config.model == ModelConfig(n_layers=1, d_model=16, n_heads=2, d_mlp=32, max_len=32, arch="llama")
    tokens = torch.randint(0, 16, (2, 32))
    with torch.no_grad():
        logits = run.load_model()(tokens)
        torch.testing.assert_close(logits, adapter.eval()(tokens)[..., :16], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "name the recipe of the task it was trained on with --recipe"),
        (("--recipe", "e1"), "the task's sequences have 64 positions; the model at"),
        (("--recipe", "e3", "--set", "task.seq_len=24"), "the task has 8 tokens; the model at"),
        (
            ("--recipe", "e2"),
            "a Hugging Face causal LM reads tokens, but the recipe's family 'regression' feeds vectors",
        ),
    ],
)
def test_pretrained_directory_that_does_not_fit_the_task_exits_2(exported, args, message):
    result = CliRunner().invoke(app, ["analyze", str(exported), *args, "--out", str(exported / "bad")])
    assert result.exit_code == 2
    assert message in result.output
    assert not (exported / "bad").exists()


def test_run_directory_options_and_export_of_our_own_model_are_clear_errors(trained, tmp_path):
    result = CliRunner().invoke(app, ["analyze", str(trained.path), "--recipe", "e1"])
    assert result.exit_code == 2 and "analyse it without --recipe" in result.output
    result = CliRunner().invoke(app, ["analyze", str(trained.path), "--set", "a=1"])
    assert result.exit_code == 2 and "analyse it without --recipe, --set and --out" in result.output
    ours = Run.create(load_recipe("e1", "quick", [s for s in TRAIN if "arch" not in s] + ["train.steps=2"]), tmp_path)
    train(ours)
    result = CliRunner().invoke(app, ["export-hf", str(ours.path), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "only models of model.arch ['gpt2', 'llama'] are Hugging Face models" in result.output


def test_export_never_overwrites_and_weightless_directories_are_named(trained, exported, tmp_path):
    """export-hf into a run directory (or any non-empty folder) is refused and the run stays whole;
    a Hugging Face folder with a config but no weights is a one-line error, not a traceback."""
    before = {p: p.read_bytes() for p in trained.path.glob("*.safetensors")}
    result = CliRunner().invoke(app, ["export-hf", str(trained.path), str(trained.path)])
    assert result.exit_code == 2 and "not an empty folder" in result.output
    assert {p: p.read_bytes() for p in trained.path.glob("*.safetensors")} == before
    from safetensors.torch import load_file

    weights = load_file(Run.open(trained.path).model_path)
    loaded = Run.open(trained.path).load_model().state_dict()
    assert weights and all(
        torch.equal(loaded[name], tensor) for name, tensor in weights.items()
    )  # the run still loads its own weights

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((exported / "config.json").read_text())
    result = CliRunner().invoke(
        app, ["analyze", str(bare), "--recipe", "e1", *sum((["--set", s] for s in TASK), []), "--sequences", "48"]
    )
    assert result.exit_code == 2 and "the Hugging Face model cannot be loaded" in result.output


def test_layer_streams_of_an_adapter_run_edits_from_the_edited_block(pair):
    """HF layers cannot resume inside a layer: an edit at resid_mid runs its whole block from the
    kept stream entering it, and equals the whole adapter's edited output."""
    _, adapter = pair
    tokens = torch.randint(0, 7, (3, 16), generator=torch.Generator().manual_seed(2))
    streams = LayerStreams(adapter, tokens)
    with torch.no_grad():
        torch.testing.assert_close(streams.model_from(None)(tokens), adapter(tokens), atol=1e-6, rtol=0)
        for site in [(1, "resid_mid"), (0, "mlp_out")]:
            with intervene(adapter, site, lambda h: 0.5 * h):
                torch.testing.assert_close(streams.model_from(site)(tokens), adapter(tokens), atol=1e-5, rtol=0)
    assert not streams.mids
