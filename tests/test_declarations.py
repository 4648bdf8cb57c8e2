"""What the analyses ask of a family is declared on the family (``TaskFamily``: ``task_probe``,
``steering_form``, ``projection_window``, ``projection_block``, ``paired_batches``,
``centred_token_effects``, ``analysed_positions``): the built-in families' values, a clear error for
a family that declares nothing, and no ``isinstance`` on a built-in family outside ``tasks/``."""

import re
from pathlib import Path

import pytest
import torch

from taskgeom.analysis.reading import projection
from taskgeom.analysis.reading.steering import study_form
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place
from taskgeom.tasks import make
from taskgeom.tasks.markov import Markov

SOURCE = Path(__file__).resolve().parents[1] / "src" / "taskgeom"
BUILT_IN = ("Dice", "Markov", "Regression", "Dyck")


def test_the_built_in_families_declare_the_study_s_choices():
    dice, markov = make("dice", vocab_size=16), make("markov", vocab_size=8, alpha=1.0)
    regression = make("regression", d=4, noise=0.5, layout="pair")
    assert (study_form(dice), study_form(markov), study_form(regression)) == ("task", "subspace", "subspace")
    # Fig. 4's block of 64 analysed positions: E1 0 to T - 3, E3 the second half less the last, E2 all but the last
    assert [projection.block(f, 64) for f in (dice, markov, regression)] == [slice(0, 62), slice(32, 63), slice(0, 63)]
    assert projection.place(regression, 16) == Place.at_depth(10, 16, 16) == Place(10, "resid_post")
    assert projection.place(markov, 6) == Place(4, "resid_post") and projection.place(dice, 2) == Place(1, "resid_post")
    assert (dice.paired_batches, markov.paired_batches, regression.paired_batches) == (False, False, True)
    assert (markov.centred_token_effects, regression.centred_token_effects) == (True, False)
    assert markov.analysed_positions(64) == slice(None)
    assert torch.equal(regression.analysed_positions(32), torch.arange(16) * 2)  # the pair layout's x tokens


def test_a_family_that_declares_nothing_is_told_what_to_declare():
    class Bare(Markov):
        name = "bare"
        steering_form = projection_window = task_probe = None

    bare = Bare(vocab_size=8, alpha=1.0)
    with pytest.raises(AnalysisError, match=r"the 'bare' family declares no steering_form \(TaskFamily.steering_form"):
        study_form(bare)
    with pytest.raises(AnalysisError, match="the 'bare' family declares no projection_window"):
        projection.block(bare, 64)


def test_no_analysis_asks_a_built_in_family_s_class():
    pattern = re.compile(r"(isinstance|issubclass)\([^)]*\b(" + "|".join(BUILT_IN) + r")\b")
    found = [
        f"{path.relative_to(SOURCE)}:{number}"
        for path in SOURCE.rglob("*.py")
        if path.parent.name != "tasks"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


class Undeclared(Markov):
    """E3's family without the declarations the analyses read, registered under E3's name."""

    steering_form = projection_window = task_probe = None


def test_reproduce_refuses_a_family_without_what_its_experiments_read_before_training(monkeypatch, tmp_path):
    from taskgeom import experiments
    from taskgeom.claims.registry import experiment
    from taskgeom.settings.config import ConfigError
    from taskgeom.settings.recipes import load_study
    from taskgeom.tasks import registry

    assert experiments.undeclared(Undeclared) == {
        "steering_form": "m1",
        "projection_window": "dual_modes",
        "task_probe": "dual_modes",
    }
    assert experiments.undeclared(Markov) == {} and experiments.undeclared(Undeclared, ("bayes_optimum",)) == {}
    registry.load_plugins()
    monkeypatch.setitem(registry.FAMILIES, "markov", Undeclared)
    out = tmp_path / "results"
    with pytest.raises(
        ConfigError, match=r"experiment m1 reads what the 'markov' family \(recipe e3\) declares no steering_form"
    ):
        experiments.reproduce(out, "quick", {"m1": experiment("m1")}, studies=(load_study("e3"),))
    with pytest.raises(ConfigError, match="declares no projection_window, task_probe"):
        experiments.reproduce(out, "quick", {"dual_modes": experiment("dual_modes")}, studies=(load_study("e3"),))
    assert not out.exists()  # refused before anything was written or trained


def test_train_says_once_what_the_family_does_not_declare(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from taskgeom.cli import app
    from taskgeom.tasks import registry

    registry.load_plugins()
    monkeypatch.setitem(registry.FAMILIES, "markov", Undeclared)
    small = ["--set", "train.steps=2", "--set", "train.eval_every=2", "--set", "train.checkpoint_every=2"]
    result = CliRunner().invoke(app, ["train", "e3", *small, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    note = (
        "note: the 'markov' family declares no steering_form, projection_window, task_probe, which m1, dual_modes read"
    )
    assert result.output.count(note) == 1
    monkeypatch.setitem(registry.FAMILIES, "markov", Markov)
    assert "note:" not in CliRunner().invoke(app, ["train", "e3", *small, "--out", str(tmp_path)]).output
