"""The paper profile, ready for whoever has the hardware: every run of its reproduction trains (a
few steps, on the CPU) at the study's sizes."""

from __future__ import annotations

import math

import pytest

from taskgeom.experiments import Context, planned_runs
from taskgeom.experiments.schedule import plan_table
from taskgeom.runs.folders import Run
from taskgeom.training.memory import parameter_count
from taskgeom.training.train import train


def test_the_paper_plan_is_the_study_s_grid_on_every_seed(tmp_path):
    table = plan_table(planned_runs(Context(tmp_path, "paper", (0, 1, 2))))
    sweep = table[table["recipe"].isin(["e1", "e2", "e3"])]
    assert sorted(sweep["diversity"].unique()) == list(range(-1, 11))
    assert len(sweep) == 3 * 12 * 3 and table["run"].is_unique and (table["steps"] == 30000).all()
    assert set(table[table["recipe"] == "e4"]["seed"]) == {0, 1, 2}


@pytest.mark.slow
def test_every_paper_run_trains_a_few_steps_on_the_cpu(tmp_path):
    tasks = {(t.config.name, t.config.task.diversity): t for t in planned_runs(Context(tmp_path, "paper", (0,)))}
    for (recipe, k), task in sorted(tasks.items()):
        config = task.config.model_copy(
            update={
                "train": task.config.train.model_copy(
                    update={
                        "steps": 2,
                        "eval_every": 2,
                        "checkpoint_every": 2,
                        "snapshots": 0,
                        "eval_batch": 8,
                        "threads": 1,
                    }
                )
            }
        )
        run = Run.create(config, tmp_path / "runs")
        record = train(run, device="cpu")
        assert run.finished and math.isfinite(record["train_loss"]), (recipe, k, record)
        model = Run.open(run.path).load_model()  # the saved weights have the study's sizes
        assert sum(p.numel() for p in model.parameters()) == parameter_count(task.config), (recipe, k)


# docs/protocol.md#the-studys-settings-the-paper-profile, recipe by recipe: (layers, activation, final norm), (batch, peak, weight decay,
# floor, schedule, clipping), the data settings of section 2.
STUDY = {
    "e1": (
        (6, "silu", False),
        (128, 4e-4, 4e-4, 1e-5, "triangular", None),
        {"vocab_size": 16, "majors": "dirichlet", "major_seed": 42, "seq_len": 128},
    ),
    "e3": ((6, "silu", False), (128, 4e-4, 4e-4, 1e-5, "triangular", None), {"vocab_size": 8, "seq_len": 192}),
    "e4": ((6, "silu", False), (128, 2e-4, 2e-4, 2e-5, "cosine", 0.4), {"n_noise": 6, "seq_len": 192}),
    "e2": (
        (16, "gelu", True),
        (256, 2e-4, 1e-4, 0.0, "triangular", 1.0),
        {"d": 6, "n_examples": 64, "noise": 0.5, "layout": "pair"},
    ),
}
CPU_PROFILES = {recipe: ("quick", "wide", "long", "deep", "standard") for recipe in ("e1", "e2", "e3", "e4")}


@pytest.mark.parametrize("recipe", sorted(STUDY))
def test_the_paper_profile_has_the_study_s_settings_and_the_cpu_profiles_those_that_cost_nothing(recipe):
    from taskgeom.settings.recipes import load_recipe

    (layers, activation, final_norm), train, data = STUDY[recipe]
    paper = load_recipe(recipe, "paper")
    assert (paper.model.n_layers, paper.model.d_model, paper.model.n_heads, paper.model.d_mlp) == (layers, 128, 2, 512)
    t = paper.train
    assert (t.batch_size, t.lr, t.weight_decay, t.lr_floor, t.schedule, t.grad_clip, t.warmup_frac, t.steps) == (
        *train,
        0.5,
        30000,
    )
    assert {key: getattr(paper.task, key) for key in data} == data
    for profile in CPU_PROFILES[recipe]:
        cpu = load_recipe(recipe, profile)
        assert (cpu.model.activation, cpu.model.final_norm) == (activation, final_norm), profile
        assert {key: getattr(cpu.task, key) for key in data if key not in ("seq_len", "d", "n_examples")} == {
            key: value for key, value in data.items() if key not in ("seq_len", "d", "n_examples")
        }, profile
        assert (cpu.train.batch_size, cpu.train.lr_floor, cpu.train.schedule, cpu.train.grad_clip) == (
            64,
            0.0,
            "triangular",
            1.0,
        ), profile
