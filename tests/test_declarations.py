"""What the analyses ask of a family is declared on the family (``TaskFamily``: ``task_probe``,
``steering_form``, ``projection_window``, ``projection_block``, ``paired_batches``,
``centred_token_effects``, ``analysed_positions``): the built-in families' values, a clear error for
a family that declares nothing, and no ``isinstance`` on a built-in family outside ``tasks/``."""

import re
from pathlib import Path

import pytest
import torch

from taskgeom.analysis.reading import projection
from taskgeom.hooks import Place
from taskgeom.analysis.reading.steering import study_form
from taskgeom.errors import AnalysisError
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
    found = [f"{path.relative_to(SOURCE)}:{number}" for path in SOURCE.rglob("*.py") if path.parent.name != "tasks"
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert found == []
