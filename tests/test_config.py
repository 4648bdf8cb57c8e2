"""Validated configs: unknown keys, impossible sizes, overrides, profiles."""

from __future__ import annotations

import pytest

from taskgeom.config import LATER_SETTINGS, ConfigError, build_config, load_config
from taskgeom.recipes import load_recipe, recipe_names

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
        (["model.arch=gpt2", "model.positions=rotary"], "^model.arch gpt2 has learned positions; leave model.positions out"),
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
LATER_VALUES = {("train", "precision"): "bf16", ("model", "arch"): "gpt2"}


def test_later_settings_keep_old_run_names_at_their_default():
    """Run directories of the first release keep their names: these digests were printed by
    taskgeom 0.1.0 (before LATER_SETTINGS existed) for the quick recipes."""
    assert load_recipe("e1", "quick", []).digest() == "df8bc40532"
    assert load_recipe("e3", "quick", []).digest() == "12a7a71f28"
    assert set(LATER_VALUES) == set(LATER_SETTINGS)
    for (section, key), value in LATER_VALUES.items():
        assert build_config(BASE, [f"{section}.{key}={value}"]).digest() != build_config(BASE).digest()
