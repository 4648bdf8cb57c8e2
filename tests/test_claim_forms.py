"""The claims' forms under the rule of docs/protocol.md (claim forms): where the package computes a
claim's ideal, the ideal passes and a null fails, and the threshold lies inside the range the value
can reach. Each form is a ``protocol.JUDGED`` field, read when a claim is judged and kept out of the
stored analyses' key; the rule's forms are the protocol's, the forms published before them the judged
variants (``taskgeom rejudge``)."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch

from taskgeom.analysis.measures.properties import fit_beta, random_token_additive_r2, token_additive_r2
from taskgeom.analysis.measures.variants import BY_NAME, JUDGED_VARIANTS, STORED_VARIANTS
from taskgeom.analysis.protocol import CHOICES, EARLIER, JUDGED, STUDY, measured_under
from taskgeom.analysis.reading import projection
from taskgeom.claims.catalog import spec
from taskgeom.claims.dual_modes import projection_drop
from taskgeom.claims.m1 import beyond_random
from taskgeom.errors import TaskgeomError
from taskgeom.studies.e2.claims import between
from taskgeom.tasks import Batch
from taskgeom.tasks.dice import Dice
from taskgeom.tasks.regression import Regression

SHARE = PARTIAL = SEGMENT = STUDY  # the rule's forms are the protocol's
ABSOLUTE, DIFFERENCE, G_INTERVAL = (
    replace(STUDY, **BY_NAME[name].fields)
    for name in ("absolute-drop", "p2-vs-random-difference", "ood-between-g-interval")
)


def test_the_claims_forms_are_judged_not_measured():
    """Changing a form leaves the stored analyses' key as it is (nothing to measure again); any
    measured choice changes it; each form names its choices; each judged variant changes forms only."""
    for name in JUDGED:
        other = next(v for v in CHOICES[name] if v != getattr(STUDY, name))
        assert replace(STUDY, **{name: other}).digest() == STUDY.digest()
    assert replace(STUDY, rank_cut=1e-5).digest() != STUDY.digest()
    assert set(JUDGED_VARIANTS) == {
        "absolute-drop",
        "p2-vs-random-difference",
        "ood-between-g-interval",
        "p3-shrinks-on-mean-curves",
        "prefix-all-lengths",
        "e2-p0-late-median",
    }
    assert not set(JUDGED_VARIANTS) & set(STORED_VARIANTS)
    # the earlier forms and search, as a manifest of format 6 records them, are the variants' fields
    earlier = {f: v for name in (*JUDGED_VARIANTS, "v-earlier-search") for f, v in BY_NAME[name].fields.items()}
    assert earlier == EARLIER and all(getattr(STUDY, name) != value for name, value in EARLIER.items())


def _judge(claim: str, value: float, reason: str | None = None) -> str:
    experiment = {"projection_r2_drop": "dual_modes", "P2.vs_random": "m1", "P3.shrinks": "m1"}[claim]
    return spec(experiment, claim).judge("e", value, None, reason).status


def _dice_codes(gen_seed: int = 0):
    """The ID-Bayes code (posterior-mean face probabilities under the pool of 4 majors) and the OOD-optimal
    code (add-one counts) of 16-face dice on 30 OOD tasks and the majors, 64 sequences a task, T = 48."""
    dice = Dice(16, 1.0, "prior", 0.0)
    pool = dice.sample_pool(4, 0, seed=gen_seed)
    ood = dice.sample_ood_tasks(30, 64, 48, seed=gen_seed)
    major = dice.sample(pool, 4 * 64, 48, seed=gen_seed, subset="major")
    return dice, pool, ood, major


def _fig4(ood: Batch, major: Batch, code) -> float:
    means = [
        projection.group_means(iter([(slice(0, len(b.task)), {"code": code(b)})]), *projection.task_groups(b))["code"]
        for b in (ood, major)
    ]
    return float(projection.fig4_r2(*means, slice(0, means[0].shape[1] - 2)).mean())


def test_projection_drop_share_ideal_passes_null_fails_and_the_absolute_form_cannot_reach_its_threshold():
    """Ideal: at k = -1 the ID-Bayes code, an affine mix of the majors (R^2 = 1); at the top of the grid the
    OOD-optimal code, the linear-code reference: the share lost is 1 - reference and passes. Null: the same
    code at both ends, nothing lost, fails. Range: a k = -1 model whose start is 0.3 that loses all of it
    cannot pass the absolute form (a drop cannot exceed its start); its share, 1, passes."""
    dice, pool, ood, major = _dice_codes()
    start = _fig4(ood, major, lambda b: dice.predict_id(b.tokens, pool))
    end = float(projection.reference(dice, ood, major).values.mean())
    assert start == pytest.approx(1.0, abs=1e-9) and end < 0.6
    with measured_under(SHARE):
        value, se, reason = projection_drop(start, end, 0.0, 0.0)
        assert reason is None and value == pytest.approx(1 - end) and _judge("projection_r2_drop", value) == "pass"
        null, _, _ = projection_drop(start, start, 0.0, 0.0)
        assert null == 0 and _judge("projection_r2_drop", null) == "fail"
        assert _judge("projection_r2_drop", projection_drop(0.3, 0.0, 0.01, 0.01)[0]) == "pass"
        assert projection_drop(0.01, 0.0, 0.01, 0.01)[2].startswith("no start to lose")
    with measured_under(ABSOLUTE):
        assert _judge("projection_r2_drop", projection_drop(0.3, 0.0, 0.01, 0.01)[0]) == "fail"
        assert projection_drop(start, end, 0.03, 0.04)[:2] == (start - end, pytest.approx(0.05))


def _states(task_scale: float, seed: int = 0):
    """(h, y, theta): token-dominated states h = mu_t + nu(x_t) + task part + a little noise, N = 600,
    T = 8, D = 24, K = 3 tasks, 4 tokens; y = h - mu_t - nu(x_t) as P2 fits it; the task part is
    alpha theta with alpha on the simplex (scale 0: no task component)."""
    gen = torch.Generator().manual_seed(seed)
    N, T, D, K, A = 600, 8, 24, 3, 4
    theta = torch.randn(K, D, generator=gen, dtype=torch.float64)
    theta -= theta.mean(0)
    nu = 3 * torch.randn(A, D, generator=gen, dtype=torch.float64)
    mu = torch.randn(T, D, generator=gen, dtype=torch.float64)
    alpha = torch.distributions.Dirichlet(torch.ones(K, dtype=torch.float64)).sample((N, T))
    tokens = torch.randint(0, A, (N, T), generator=gen)
    y = task_scale * alpha @ theta + 0.05 * torch.randn(N, T, D, generator=gen, dtype=torch.float64)
    return mu + nu[tokens] + y, y, theta


@pytest.mark.parametrize("scale", [1.0, 0.0])
def test_p2_vs_random_partial_ideal_passes_null_fails_where_the_difference_cannot(scale):
    """The study's r2_additive and its random-subspace baseline (``token_additive_r2``, the claim's
    functions) on states with the task simplex (ideal: partial ~1, passes) and without (null: ~0,
    fails). On these token-dominated states the random baseline keeps the token effect, so the
    difference's ceiling 1 - r2_random lies below 0.3 and even the ideal fails it."""
    h, y, theta = _states(scale)
    positions = slice(0, h.shape[1])
    r2 = float(token_additive_r2(h, y, fit_beta(y, theta) @ theta).nanmean())
    r2_random = float(random_token_additive_r2(h, y, theta, positions, 5, 0).mean())
    partial = beyond_random(r2, r2_random, PARTIAL, {})
    difference = beyond_random(r2, r2_random, DIFFERENCE, {})
    assert 1 - r2_random < 0.3 and _judge("P2.vs_random", difference.value) == "fail"
    if scale:
        assert partial.value > 0.95 and _judge("P2.vs_random", partial.value) == "pass"
    else:
        assert abs(partial.value) < 0.1 and _judge("P2.vs_random", partial.value) == "fail"
    assert partial.parts["difference"] == pytest.approx(difference.value)
    assert beyond_random(0.9, 1.0, PARTIAL, {}).reason.startswith("the random subspace leaves nothing")


@pytest.mark.parametrize("r2_random", [-0.16, -0.5, 0.0, 0.4])
def test_p2_vs_random_partial_ranges_up_to_1_whatever_the_baseline(r2_random):
    """A random baseline below 0 (E2's simplex-constrained fit can do worse than the mean state): the
    share still reaches 1 exactly at the ideal r2 = 1 (passes) and is 0 where the simplex explains no
    more than the random subspace (fails), so 0.3 lies inside its range; at a baseline of 0 it is
    the difference."""
    ideal = beyond_random(1.0, r2_random, PARTIAL, {})
    null = beyond_random(r2_random, r2_random, PARTIAL, {})
    assert ideal.value == pytest.approx(1.0) and _judge("P2.vs_random", ideal.value) == "pass"
    assert null.value == 0.0 and _judge("P2.vs_random", null.value) == "fail"
    halfway = beyond_random(r2_random + 0.5 * (1 - r2_random), r2_random, PARTIAL, {})
    assert halfway.value == pytest.approx(0.5)  # half of what the random subspace leaves
    if r2_random == 0.0:
        assert halfway.value == pytest.approx(halfway.parts["difference"])


def test_ood_between_segment_passes_both_ideals_and_fails_a_predictor_outside():
    """E2 at k = -1 on OOD prompts (d = 8, 3 majors, 64 examples): dMMSE and ridge as the model are the
    two ideals and pass the segment form (value 0 at each); dMMSE's prediction doubled, outside the
    segment, fails. The published form puts dMMSE on its boundary: a model 5% worse than dMMSE OOD,
    within bayes_optimal's 10%, fails it and passes the segment."""
    family = Regression(8, 0.5, "pair", major_seed=3)
    pool = family.sample_pool(3, 0)
    ood = family.sample_ood(512, 128, seed=1)
    dmmse, ridge = family.reference_predictions(ood, pool)
    late = slice(32, 64)

    def mse(prediction):
        return float(((prediction - ood.y.double()) ** 2)[:, late].mean())

    ends = (mse(dmmse), mse(ridge))
    assert ends[0] > ends[1]  # OOD, ridge is the better predictor
    with measured_under(SEGMENT):
        for ideal in ends:
            spec, value, _ = between(ideal, *ends)
            assert value == pytest.approx(0.0, abs=1e-12) and spec.judge("e2", value).status == "pass"
        spec, value, parts = between(mse(2 * dmmse), *ends)
        assert spec.threshold == 0.1 and value > 0.1 and spec.judge("e2", value).status == "fail"
        spec, value, parts = between(1.05 * ends[0], *ends)
        assert spec.judge("e2", value).status == "pass" and parts["g"] < 0
    with measured_under(G_INTERVAL):
        spec, value, _ = between(1.05 * ends[0], *ends)
        assert spec.threshold == 0.5 and spec.judge("e2", value).status == "fail"
        assert between(mse(2 * dmmse), *ends)[1] > 0.5


@pytest.mark.parametrize("variant", JUDGED_VARIANTS)
def test_each_judged_variant_moves_only_its_claims(tiny_reproduction, tmp_path, variant):
    """Every judged variant on the smoke reproduction's stored analyses (the rows each form reads
    are there: the trajectory's posterior, the prefix probe's kept lengths): only the claims it names
    can move, each judged with its form's description, and the manifest records the form."""
    from taskgeom.experiments.request import rejudge

    out = tmp_path / variant
    rejudge(tiny_reproduction, out, variant)
    old = {c["id"]: c for c in json.loads((tiny_reproduction / "claims.json").read_text())}
    new = {c["id"]: c for c in json.loads((out / "claims.json").read_text())}
    assert old.keys() == new.keys()
    moved = [key for key in old if old[key]["seeds"] != new[key]["seeds"]]
    assert all(BY_NAME[variant].moves(key.split(".", 1)[1]) for key in moved), moved
    named = [key for key in new if BY_NAME[variant].moves(key.split(".", 1)[1])]
    assert named and all(new[key]["description"] != old[key]["description"] for key in named)
    recorded = json.loads((tiny_reproduction / "reproduction.json").read_text())["forms"]
    assert json.loads((out / "reproduction.json").read_text())["forms"] == {**recorded, **BY_NAME[variant].fields}


def test_rejudge_judges_a_reproduction_again_under_one_form_and_moves_only_its_claim(tiny_reproduction, tmp_path):
    """``taskgeom rejudge`` on the smoke reproduction: under ``p2-vs-random-difference`` only the
    P2.vs_random claims move (each seed's value the difference of its stored parts), every other
    claim is the same bit for bit; it changes no byte of the results folder (the evaluations every
    reproduction computes again are written again, the same) and refuses a variant
    of the measurement, a folder that is not empty and a reproduction with an analysis missing."""
    from taskgeom.experiments.request import rejudge

    source = tmp_path / "results"
    shutil.copytree(tiny_reproduction, source)
    before = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    out = tmp_path / "difference"
    rejudge(source, out, "p2-vs-random-difference")
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before
    old = {c["id"]: c for c in json.loads((source / "claims.json").read_text())}
    new = {c["id"]: c for c in json.loads((out / "claims.json").read_text())}
    assert old.keys() == new.keys()
    moved = [key for key in old if old[key]["seeds"] != new[key]["seeds"]]
    assert moved and all(key.endswith(".P2.vs_random") for key in moved)
    for key in moved:
        for seed in new[key]["seeds"]:
            parts = seed["parts"]
            if seed["status"] != "n/a":
                additive, random = parts["r2_additive"], parts["r2_additive_random"]
                assert seed["value"] == additive - random
    recorded = json.loads((source / "reproduction.json").read_text())["forms"]
    assert json.loads((out / "reproduction.json").read_text())["forms"] == {**recorded, "p2_random_form": "difference"}
    with pytest.raises(TaskgeomError, match="no variant of the claims' forms"):
        rejudge(source, tmp_path / "other", "site-mid")
    with pytest.raises(TaskgeomError, match="not empty"):
        rejudge(source, out, "absolute-drop")
    shutil.rmtree(next((source / "runs").glob("e1-*/analysis")))
    with pytest.raises(TaskgeomError, match="lacks the stored runs or analyses"):
        rejudge(source, tmp_path / "third", "absolute-drop")
    assert not (tmp_path / "third").exists()


def _trajectory_rows(beta: torch.Tensor, alpha: torch.Tensor) -> list[dict]:
    """The m1.json rows P3.shrinks' trajectory form reads, for task 0's mean beta and mean posterior [P, K]."""
    tv, top = 0.5 * (beta - alpha).abs().sum(-1), alpha.amax(-1)
    return [
        {
            "metric": metric,
            "value": float(v),
            "batch": "trajectory",
            "position": t,
            "task": 0,
            "layer": 2,
            "site": "resid_post",
        }
        for metric, curve in (("p3.tv_trajectory", tv), ("p3.trajectory_alpha_max", top))
        for t, v in enumerate(curve.tolist())
    ]


def test_p3_shrinks_on_the_trajectory_ideal_passes_null_fails():
    """Task 0's mean exact posterior over 60 positions of 16-face dice with 4 majors (the trajectory P3
    reads): the ideal, beta = alpha, passes (value 0); the null, beta fixed at the simplex centre while
    the posterior moves away from it, fails (the late TV exceeds the early one). A run whose posterior
    is certain almost at once has too few uncertain positions: n/a."""
    from taskgeom.claims.m1 import trajectory_shrinks
    from taskgeom.hooks import Place

    dice = Dice(16, 1.0, "prior", 0.0)
    pool = dice.sample_pool(4, 0, seed=1)
    batch = dice.make_batch(
        pool.params[[0] * 256], torch.zeros(256, dtype=torch.long), 60, torch.Generator().manual_seed(0)
    )
    alpha = dice.log_posterior(batch.tokens, pool).exp().double().mean(0)  # [60, 4]
    place = Place(2, "resid_post")
    with measured_under(STUDY):
        ideal = trajectory_shrinks(_trajectory_rows(alpha, alpha), place, {})
        null = trajectory_shrinks(_trajectory_rows(torch.full_like(alpha, 0.25), alpha), place, {})
        sure = torch.nn.functional.one_hot(torch.zeros(60, dtype=torch.long), 4).double()
        certain = trajectory_shrinks(_trajectory_rows(sure, sure), place, {})
    assert ideal.parts["uncertain_positions"] >= 5 and ideal.value == 0 and _judge("P3.shrinks", ideal.value) == "pass"
    assert null.value > 1 and _judge("P3.shrinks", null.value) == "fail"
    assert math.isnan(certain.value) and "uncertain" in certain.reason


def _prefix_pool(informative: bool, seed: int = 0):
    """{l: (h [600, 8], y [600])} for l = 1..4 over 8 random binary words: the label of a state is the
    class of its word's first l symbols (``prefix_classes``); h a scaled one-hot of the word plus a little
    noise (the ideal: every prefix recoverable) or Gaussian noise alone (the null)."""
    from taskgeom.studies.e4.prefix import prefix_classes

    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 2, (8, 6), generator=gen)
    classes = prefix_classes(words, 4)
    which = torch.randint(0, 8, (600,), generator=gen)
    noise = torch.randn(600, 8, generator=gen)
    h = 3 * torch.nn.functional.one_hot(which, 8).float() + 0.1 * noise if informative else noise
    pool = {
        length: (h, torch.tensor([found[tuple(words[w, :length].tolist())] for w in which.tolist()]))
        for length, found in classes.items()
    }
    return pool, {length: len(found) for length, found in classes.items()}


@pytest.mark.parametrize("informative", [True, False])
def test_prefix_probe_trained_lengths_ideal_passes_null_fails(informative):
    """The study's probe (``train_probe``, its curriculum and kept snapshot) and its shuffled-label control
    on states that hold every prefix (ideal: passes) or none (null: fails), judged at the lengths the kept
    probe trained against the control or the chance level; a probe kept after two lengths is read there only."""
    from taskgeom.analysis.protocol import PrefixProbeSettings
    from taskgeom.studies.e4.claims import prefix_probe
    from taskgeom.studies.e4.prefix import shuffled, train_probe

    settings = PrefixProbeSettings(
        epochs=300, lr=3e-2, mini_batch=64, samples_per_class=20, curriculum_threshold=0.3, loss_threshold=1e-3
    )
    pool, n_classes = _prefix_pool(informative)
    probe = train_probe(pool, n_classes, 8, torch.Generator().manual_seed(1), settings)
    control = train_probe(
        shuffled(pool, torch.Generator().manual_seed(2)), n_classes, 8, torch.Generator().manual_seed(3), settings
    )
    lengths = {
        name: {n: (n in r.kept_lengths, r.chance[n]) for n in r.accuracy}
        for name, r in (("probe", probe), ("control", control))
    }
    with measured_under(STUDY):
        claim = prefix_probe("e4", probe.accuracy, control.accuracy, probe.reached, 1, "resid_mid", 10, 0.0, lengths)
        if informative:
            assert probe.kept_lengths == (1, 2, 3, 4) and claim.status == "pass"
            two = {"probe": {n: (n <= 2, 0.5) for n in lengths["probe"]}, "control": lengths["control"]}
            early = prefix_probe("e4", probe.accuracy, control.accuracy, 2, 1, "resid_mid", 10, 0.0, two)
            assert early.parts["lengths"] == "1,2" and early.parts["lengths_trained"] == "1,2"
        else:
            assert claim.status == "fail" and claim.value < 0.1 and probe.kept_lengths[:2] == (1, 2)
    labels = {n: torch.bincount(y).max().item() / len(y) for n, (_, y) in pool.items()}
    assert all(abs(probe.chance[n] - labels[n]) < 0.15 for n in labels)  # the validation split's largest class share


def test_the_kept_lengths_are_those_the_kept_snapshot_had_trained():
    """A probe that stops at the very evaluation that brings the last length in (its loss threshold met
    on the lengths then in training) never trained that length's head: it is not among the kept lengths,
    and the prefix claim in the rule's form does not read it; with a strict loss threshold every length
    is trained after the reset and kept."""
    from taskgeom.analysis.protocol import PrefixProbeSettings
    from taskgeom.studies.e4.prefix import train_probe

    pool, n_classes = _prefix_pool(True)
    for threshold, kept in ((0.3, (1, 2, 3)), (0.05, (1, 2, 3, 4))):
        settings = PrefixProbeSettings(
            epochs=300, lr=3e-2, mini_batch=64, samples_per_class=20, curriculum_threshold=0.3, loss_threshold=threshold
        )
        result = train_probe(pool, n_classes, 8, torch.Generator().manual_seed(1), settings)
        assert result.reached == 4 and result.kept_lengths == kept, threshold
        if kept[-1] == 3:
            assert result.accuracy[4] < result.chance[4] + 0.1  # the untrained head: at about chance
