"""Validated configs: unknown keys, impossible sizes, overrides, profiles."""

from __future__ import annotations

import re

import pytest
import typer
import yaml

from taskgeom.cli import app
from taskgeom.settings.config import LATER_SETTINGS, ConfigError
from taskgeom.settings.recipes import (
    build_config,
    common_profiles,
    load_config,
    load_recipe,
    read_recipe,
    recipe_names,
    recipe_path,
    shared_profiles,
)

BASE = {"name": "x", "task": {"family": "dice"}}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.stepz=3"], "unknown config field 'train.stepz'"),
        (["task.colour=red"], "unknown config field 'task.colour'"),
        (["model.d_model=0"], "'model.d_model'"),
        (["train.batch_size=-4"], "'train.batch_size'"),
        (["task.seq_len=300"], "exceeds model.max_len"),
        (["model.d_model=30", "model.n_heads=4"], "divisible"),
        (["task.family=dicey"], "dicey"),
        (["task.p_minor=1.5"], "'task.p_minor'"),
        (["steps"], "section.key=value"),
        (
            ["model.arch=gpt2", "model.positions=rotary"],
            "^model.arch gpt2 has learned positions; leave model.positions out",
        ),
    ],
)
def test_bad_settings_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(BASE, overrides)


def test_overrides_are_typed_and_change_the_digest():
    a = build_config(BASE)
    b = build_config(BASE, ["train.steps=7", "task.diversity=4"])
    assert b.train.steps == 7 and b.task.diversity == 4
    assert a.digest() != b.digest() and a.digest() == build_config(BASE).digest()


def test_every_shipped_recipe_loads_in_both_profiles():
    assert {"e1", "e3"} <= set(recipe_names())
    for name in recipe_names():
        for profile in ("quick", "paper"):
            assert load_recipe(name, profile).name == name


def test_the_shared_profiles_are_every_recipe_s_unless_it_defines_its_own(tmp_path):
    """wide, deep and smoke are written once (configs/shared/profiles.yaml) and extend each recipe's
    quick; a recipe's own profile of the name wins; one without quick gets none; a profile's about is
    its own, and --profile's help lists the profiles every shipped recipe has with theirs."""
    for name in recipe_names():
        quick = load_recipe(name, "quick").model_dump()
        for profile, changed in shared_profiles().items():
            config = load_recipe(name, profile).model_dump()
            for section in ("task", "model", "train"):
                assert config[section] == quick[section] | changed.get(section, {}), (name, profile, section)
        assert read_recipe(recipe_path(name)).about("deep") == shared_profiles()["deep"]["about"]
        assert read_recipe(recipe_path(name)).about("standard") != read_recipe(recipe_path(name)).about("deep")
    own = tmp_path / "own.yaml"
    base = {"name": "own", "task": {"family": "dice", "seq_len": 16}}
    own.write_text(yaml.safe_dump({"base": base, "profiles": {"quick": {}, "wide": {"model": {"d_model": 32}}}}))
    assert load_config(own, "wide").model.d_model == 32 and load_config(own, "smoke").train.steps == 30
    lone = tmp_path / "lone.yaml"
    lone.write_text(yaml.safe_dump({"base": base, "profiles": {"small": {}}}))
    with pytest.raises(ConfigError, match=r"unknown profile 'deep'; available: \['small'\]"):
        load_config(lone, "deep")
    option = next(p for p in typer.main.get_command(app).commands["reproduce"].params if p.name == "profile")
    for profile, about in common_profiles().items():
        assert f"{profile} ({about})" in option.help, profile
    assert {"quick", "deep", "standard", "paper", "wide", "long", "smoke"} == set(common_profiles())


def test_a_profile_that_extends_another_changes_only_what_it_names():
    """Every rung of the ladder is quick with the one thing it names changed."""
    quick = load_recipe("e1", "quick").model_dump()
    wide, long = load_recipe("e1", "wide").model_dump(), load_recipe("e1", "long").model_dump()
    assert wide["model"] | {"d_model": 64, "d_mlp": 256} == quick["model"] and wide["model"]["d_model"] == 128
    assert {k: v for k, v in wide.items() if k != "model"} == {k: v for k, v in quick.items() if k != "model"}
    assert (
        long["train"] | {"steps": quick["train"]["steps"]} == quick["train"]
        and long["train"]["steps"] == 2 * quick["train"]["steps"]
    )
    assert load_recipe("e2", "deep").model.n_layers == 6


@pytest.mark.parametrize(
    "profiles, message",
    [
        ("{a: {extends: b}, b: {extends: a}}", "extend each other in a cycle: a -> b -> a"),
        ("{a: {extends: nowhere}}", "unknown profile 'nowhere'"),
        ("{a: {extends: [b]}, b: {}}", "profiles.a.extends must name another profile"),
    ],
)
def test_profiles_that_extend_wrongly_are_named(tmp_path, profiles, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {{name: r, task: {{family: dice}}}}\nprofiles: {profiles}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(recipe, "a")


def test_recipe_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown profile 'fast'"):
        load_recipe("e1", "fast")
    with pytest.raises(ConfigError, match="no config file"):
        load_recipe("e9")
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: {name: a, task: {family: dice}}\nprofiles: {quick: {}}\nextra: 1\n")
    with pytest.raises(ConfigError, match="unknown top-level keys"):
        load_config(bad)


# A value away from the default for every later setting (add one here with each new setting).
LATER_VALUES = {
    ("train", "precision"): "bf16",
    ("model", "arch"): "gpt2",
    ("model", "activation"): "silu",
    ("model", "final_norm"): "false",
    ("train", "schedule"): "cosine",
    ("train", "lr_floor"): "1.0e-5",
    ("task", "major_seed"): "7",
}
# The quick recipes as they were in taskgeom 0.1.0, from today's (issue 26 moved them to the study's settings).
FIRST_RELEASE = {
    "e1": ["task.vocab_size=6", "task.majors=disjoint", "model.activation=gelu", "model.final_norm=true"],
    "e3": ["model.activation=gelu", "model.final_norm=true"],
}


def test_later_settings_keep_old_run_names_at_their_default():
    """Run directories of the first release keep their names: these digests were printed by
    taskgeom 0.1.0 (before LATER_SETTINGS existed) for the quick recipes (as they were then: the
    torch thread count left to torch)."""
    assert load_recipe("e1", "quick", ["train.threads=0", *FIRST_RELEASE["e1"]]).digest() == "df8bc40532"
    assert load_recipe("e3", "quick", ["train.threads=0", *FIRST_RELEASE["e3"]]).digest() == "12a7a71f28"
    assert set(LATER_VALUES) == set(LATER_SETTINGS)
    for (section, key), value in LATER_VALUES.items():
        assert build_config(BASE, [f"{section}.{key}={value}"]).digest() != build_config(BASE).digest()


# ---- strict types, finite numbers, family constraints (issue 12) ---------------------------------
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.steps=true"], r"^config field 'train.steps': Input should be a valid integer \(got True\)$"),
        (["train.steps=1.0"], r"^config field 'train.steps': Input should be a valid integer \(got 1.0\)$"),
        (["task.diversity=false"], r"^config field 'task.diversity': Input should be a valid integer \(got False\)$"),
        (["train.seed='3'"], r"^config field 'train.seed': Input should be a valid integer \(got '3'\)$"),
        (["train.lr=.inf"], r"^config field 'train.lr': Input should be a finite number \(got inf\)$"),
        (["train.lr=-.inf"], r"^config field 'train.lr': Input should be a finite number \(got -inf\)$"),
        (["train.grad_clip=.nan"], r"^config field 'train.grad_clip': Input should be a finite number \(got nan\)$"),
        (
            ["train.weight_decay=true"],
            r"^config field 'train.weight_decay': Input should be a number, not a boolean \(got True\)$",
        ),
        (
            ["task.vocab_size=2", "task.n_major=5"],
            r"^task.majors disjoint gives each major task faces of its own: task.n_major \(5\) must not "
            r"exceed task.vocab_size \(2\); raise task.vocab_size or set task.majors=prior$",
        ),
        (
            ["train.grad_clip=0"],
            r"^train.grad_clip must be a positive gradient norm, or null for no clipping \(got 0\)$",
        ),
        (
            ["train.grad_clip=-1.5"],
            r"^train.grad_clip must be a positive gradient norm, or null for no clipping \(got -1.5\)$",
        ),
        (["train.lr_floor=1.0e-3"], r"^train.lr_floor \(0.001\) must be below the peak train.lr \(0.0004\)$"),
        (["train.lr_floor=-1.0e-5"], r"^config field 'train.lr_floor': Input should be greater than or equal to 0"),
        (
            ["train.schedule=step"],
            r"^config field 'train.schedule': Input should be 'triangular' or 'cosine' \(got 'step'\)$",
        ),
        (
            ["model.activation=relu"],
            r"^config field 'model.activation': Input should be 'gelu' or 'silu' \(got 'relu'\)$",
        ),
        (["model.final_norm=1"], r"^config field 'model.final_norm': Input should be a valid boolean \(got 1\)$"),
        (
            ["task.majors=uniform"],
            r"^config field 'task.majors': Input should be 'dirichlet', 'prior' or 'disjoint' \(got 'uniform'\)$",
        ),
        (["task.major_seed=1.5"], r"^config field 'task.major_seed': Input should be a valid integer \(got 1.5\)$"),
        (["train.steps=[1"], r"^override 'train.steps=\[1': the value is not valid YAML \(.* at line 1, column 3\)$"),
        (["train.steps=!!int 3"], r"^override 'train.steps=!!int 3': YAML tags \(!...\) are not allowed in a value"),
        (["name=!!python/name:os.system"], r"YAML tags"),
    ],
)
def test_strict_values_are_refused_with_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(BASE, overrides)


def test_hugging_face_models_keep_their_own_mlp_and_final_norm():
    """A recipe's activation and final_norm are our model's: with model.arch gpt2 or llama they are
    reset, so ``--set model.arch=gpt2`` works on every recipe and names one model once."""
    plain = build_config(BASE, ["model.arch=gpt2"])
    ours = build_config(BASE, ["model.activation=silu", "model.final_norm=false", "model.arch=gpt2"])
    assert (ours.model.activation, ours.model.final_norm) == ("gelu", True) and ours.digest() == plain.digest()
    assert load_recipe("e1", "quick", ["model.arch=llama"]).model.final_norm is True


def test_no_clipping_and_the_schedule_are_settings():
    cfg = build_config(
        BASE, ["train.grad_clip=null", "train.schedule=cosine", "train.lr_floor=2.0e-5", "train.lr=2.0e-4"]
    ).train
    assert (cfg.grad_clip, cfg.schedule, cfg.lr_floor, cfg.lr) == (None, "cosine", 2e-5, 2e-4)


def test_plain_values_still_read_as_before():
    cfg = build_config(
        BASE,
        [
            "train.lr=1e-3",
            "train.lr=2.5e-3",
            "train.weight_decay=0",
            "task.majors=prior",
            "task.vocab_size=2",
            "task.n_major=5",
            "train.steps=7",
        ],
    )
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.task.n_major, cfg.train.steps) == (2.5e-3, 0.0, 5, 7)
    assert (
        build_config(BASE, ["train.lr='1e-3'"]).train.lr == 1e-3
    )  # YAML 1.1 reads 1e-3 as text; a number in text stays allowed


@pytest.mark.parametrize(
    "text,message",
    [
        ("profiles: [quick]\n", r"'profiles' must be a mapping of profile names to settings, got a list$"),
        ("profiles: {quick: 5}\n", r"profiles.quick must be a mapping of settings, got the int 5$"),
        ("profiles: {quick: x}\n", r"profiles.quick must be a mapping of settings, got the str 'x'$"),
        ("profiles: {quick: {}}\nbase2: 1\n", r"unknown top-level keys \['base2'\]"),
        ("profiles: {quick: {}}\n1: 2\n", r"unknown top-level keys \[1\]"),
        (
            "profiles: {quick: !!python/tuple [1]}\n",
            r"not valid YAML \(could not determine a constructor .* at line 2, column 19\)$",
        ),
    ],
)
def test_malformed_recipes_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text("base: {name: a, task: {family: dice}}\n" + text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_a_recipe_that_is_not_utf8(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"base: {name: caf\xe9, task: {family: dice}}\nprofiles: {quick: {}}\n")
    with pytest.raises(
        ConfigError, match=r"r.yaml: not UTF-8 text \(byte 0xe9 at offset 16\); save the recipe as UTF-8$"
    ):
        load_config(path)


# ---- memory estimates ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["dice", "markov", "dyck", "regression"])
@pytest.mark.parametrize("arch", ["taskgeom", "taskgeom-learned", "gpt2", "llama"])
def test_parameter_count_matches_the_built_model(family, arch):
    from taskgeom.runs.folders import Run
    from taskgeom.training.memory import parameter_count

    if arch in ("gpt2", "llama"):
        if family == "regression":
            pytest.skip("the Hugging Face models read tokens")
        pytest.importorskip("transformers")
    model = {"n_layers": 2, "d_model": 32, "n_heads": 2, "d_mlp": 64, "max_len": 64}
    model |= {"positions": "learned"} if arch == "taskgeom-learned" else {"arch": arch}
    task = {"family": family} | ({} if family == "regression" else {"seq_len": 32})
    cfg = build_config({"name": "x", "task": task, "model": model})
    real = sum(p.numel() for p in Run("unused", cfg).new_model().parameters())
    if arch.startswith("taskgeom"):
        assert parameter_count(cfg) == real
    else:
        assert abs(parameter_count(cfg) / real - 1) < 0.03


def test_training_memory_parts_and_the_refusal():
    from taskgeom.errors import EnvironmentRefused
    from taskgeom.training.memory import MemoryRefused, check_training_memory, parameter_count, training_memory

    cfg = build_config(
        BASE,
        [
            "train.batch_size=8",
            "train.eval_batch=16",
            "task.seq_len=32",
            "model.d_model=64",
            "model.d_mlp=256",
            "task.diversity=3",
        ],
    )
    need = training_memory(cfg)
    assert need["weights"] == 16 * parameter_count(cfg)
    assert need["bayes"] == 3 * 8 * 16 * 32 * (3 + 8)  # three float64 [eval_batch, T, pool] tensors
    assert need["activations"] == max(
        8 * 32 * (2 * 4 * (10 * 64 + 2 * 256) + 3 * 4 * 6), 16 * 32 * (4 * (10 * 64 + 2 * 256) + 2 * 8 * 6)
    )
    total = sum(need.values())
    check_training_memory(cfg, total, "here")  # exactly enough
    check_training_memory(cfg, None, "here")  # unknown: not checked
    with pytest.raises(
        MemoryRefused,
        match=r"^training x \(.* parameters\) needs at least .* \(weights .*, activations .*, bayes .*\), "
        r"more than the 1.0 KiB of memory available on here; reduce model.d_model",
    ) as info:
        check_training_memory(cfg, 1024, "here")
    assert isinstance(info.value, EnvironmentRefused)
    with pytest.raises(MemoryRefused, match="bayes"):  # on a GPU the exact posterior is checked against the host
        check_training_memory(cfg, total, "cuda:0", host=(need["bayes"] - 1, "this machine (cpu)"))


def test_analysis_memory_grows_with_the_sequences():
    from taskgeom.training.memory import analysis_memory, format_bytes

    cfg = build_config(BASE)
    assert (
        analysis_memory(cfg, 2000) - analysis_memory(cfg, 1000)
        == analysis_memory(cfg, 1000) - analysis_memory(cfg, 0)
        > 0
    )
    assert analysis_memory(load_recipe("e1", "quick"), 100_000_000) > 2**40  # the input: terabytes
    assert analysis_memory(load_recipe("e1", "paper"), 512) < 2**30  # the default stays well below a laptop's memory
    assert [format_bytes(n) for n in (5, 1536, 3 * 2**30)] == ["5 bytes", "1.5 KiB", "3.0 GiB"]


def test_a_profile_s_measure_section_is_read_from_the_recipe(tmp_path):
    """The diversity grid and Fig. 4's sizes are the recipe's, per profile (inherited through
    extends): every shipped profile's grid ends at the study's k = 10 (every recipe, E4's prefix
    probes included, reads its top), the study's 128 x 128 at every shipped profile; the grid is
    left out of the run config."""
    from taskgeom.experiments.sweep import Job
    from taskgeom.settings.recipes import MeasureSettings, load_measure, recipe_path

    for name in ("e1", "e2", "e3", "e4"):
        for profile in ("quick", "deep", "standard", "wide", "long", "paper"):
            measure = load_measure(recipe_path(name), profile)
            assert measure.projection_sizes == (
                1024,
                128,
            )  # the claims read 1,024 OOD tasks; the study's 128 are a written row
            assert measure.grid == (
                [-1, *range(11)] if profile == "paper" else [-1, 4, 10]
            )  # points of the study's Fig. 4 grid
            assert max(measure.grid) == 10  # the claims read the top, where the study's Fig. 4 ends
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "base": {"name": "mine", "task": {"family": "dice", "seq_len": 16}},
                "profiles": {
                    "quick": {"measure": {"grid": [-1, 2], "projection_tasks": 16}},
                    "small": {"extends": "quick", "measure": {"projection_per_task": 8}},
                },
            }
        )
    )
    assert Job(str(recipe), -1, 0, "small").measure() == MeasureSettings(
        grid=[-1, 2], projection_tasks=16, projection_per_task=8
    )
    assert Job(str(recipe), -1, 0, "small").config().task.seq_len == 16
    recipe.write_text(
        yaml.safe_dump(
            {
                "base": {"name": "mine", "task": {"family": "dice"}},
                "profiles": {"quick": {"measure": {"projection_tasks": 0, "grids": [1]}}},
            }
        )
    )
    with pytest.raises(
        ConfigError,
        match=r"profiles.quick.measure.projection_tasks.*unknown config field 'profiles.quick.measure.grids'|"
        r"unknown config field 'profiles.quick.measure.grids'.*projection_tasks",
    ):
        load_measure(recipe, "quick")


def test_a_recipe_is_parsed_once_and_every_profile_s_measure_is_validated_with_it(tmp_path, monkeypatch):
    """load_study, load_config and load_measure read one parse of the file (until it changes); a
    wrong ``measure`` section in any profile is refused when the recipe is read, naming that profile."""
    from taskgeom.settings.recipes import load_measure, load_study

    shared_profiles()  # read once per process, before counting
    parses = []
    real_load = yaml.safe_load
    monkeypatch.setattr(yaml, "safe_load", lambda text: parses.append(1) or real_load(text))
    recipe = tmp_path / "mine.yaml"
    body = {
        "base": {"name": "mine", "task": {"family": "dice", "seq_len": 16}},
        "profiles": {"quick": {"measure": {"grid": [-1, 2]}}, "big": {"extends": "quick", "train": {"steps": 7}}},
        "study": {"section": "Mine", "experiments": {"m1": {}}},
    }
    recipe.write_text(yaml.safe_dump(body, sort_keys=False))
    study, config, measure = load_study(recipe), load_config(recipe, "big"), load_measure(recipe, "big")
    assert (study.profiles, config.train.steps, measure.grid, len(parses)) == (
        ("quick", "big", "wide", "deep", "smoke"),  # its own, then those every recipe shares
        7,
        [-1, 2],
        1,
    )
    body["profiles"]["big"]["measure"] = {"grid": [3]}  # one k: a sweep needs two
    recipe.write_text(yaml.safe_dump(body, sort_keys=False))
    with pytest.raises(ConfigError, match=r"mine.yaml: config field 'profiles.big.measure.grid'"):
        load_config(recipe, "quick")
    assert len(parses) == 2
