"""The whole machine, the same bits: portable kernels (taskgeom.settings.kernels), the default worker count, the memory cap of the schedule and the wall-time estimate of a plan."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from taskgeom.cli import app
from taskgeom.settings import kernels
from taskgeom.settings.devices import default_workers, usable_cores

AVX2_FLAGS = {"sse2", "avx", "avx2", "fma"}


def test_an_x86_cpu_with_avx2_pins_aten_mkl_and_onednn():
    choice = kernels.choose(environ={}, machine="x86_64", flags=AVX2_FLAGS | {"avx512f"})
    assert choice.mode == "pinned" and choice.variables == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }


@pytest.mark.parametrize(
    "machine, flags, why",
    [("aarch64", {"asimd"}, "not x86-64"), ("arm64", set(), "not x86-64"), ("x86_64", {"sse2", "avx"}, "no AVX2")],
)
def test_a_cpu_that_cannot_hold_the_pins_runs_natively_and_says_why(machine, flags, why):
    choice = kernels.choose(environ={}, machine=machine, flags=flags)
    assert (
        choice.mode == "native"
        and choice.variables == {}
        and why in choice.reason
        and "bits will differ" in choice.reason
    )


def test_a_variable_the_user_set_is_kept_and_no_other_is_added():
    choice = kernels.choose(environ={"ATEN_CPU_CAPABILITY": "default"}, machine="x86_64", flags=AVX2_FLAGS)
    assert choice.mode == "user" and choice.variables == {"ATEN_CPU_CAPABILITY": "default"}
    assert (
        kernels.choose(native=True, environ={"MKL_CBWR": "COMPATIBLE"}, machine="x86_64", flags=AVX2_FLAGS).mode
        == "user"
    )


def test_pins_set_by_an_earlier_choice_are_not_mistaken_for_the_users():
    ours = dict(kernels.PINS) | {kernels.CHOICE_VARIABLE: "pinned"}
    assert kernels.choose(environ=ours, machine="x86_64", flags=AVX2_FLAGS).mode == "pinned"
    assert kernels.choose(native=True, environ=ours, machine="x86_64", flags=AVX2_FLAGS).mode == "native"


@pytest.fixture
def environ(monkeypatch):
    """A copy of the environment without kernel variables, restored after the test."""
    copy = {k: v for k, v in os.environ.items() if k not in (*kernels.PINS, kernels.CHOICE_VARIABLE)}
    monkeypatch.setattr(os, "environ", copy)
    return copy


def _run(*args):
    return CliRunner().invoke(app, [*args, "reproduce", "--plan", "--only", "e4", "--seeds", "0"])


def test_the_cli_pins_the_kernels_by_default_and_honours_native_kernels_and_the_users_variable(environ):
    if kernels.choose(environ={}).mode != "pinned":
        pytest.skip("this CPU cannot hold the pins")
    assert _run().exit_code == 0
    assert {k: environ.get(k) for k in kernels.PINS} == kernels.PINS and environ[kernels.CHOICE_VARIABLE] == "pinned"
    assert _run("--native-kernels").exit_code == 0
    assert not any(k in environ for k in kernels.PINS) and environ[kernels.CHOICE_VARIABLE] == "native"
    environ.clear()
    environ["ATEN_CPU_CAPABILITY"] = "default"
    assert _run().exit_code == 0
    assert (
        environ["ATEN_CPU_CAPABILITY"] == "default"
        and "MKL_CBWR" not in environ
        and environ[kernels.CHOICE_VARIABLE] == "user"
    )


def test_the_manifest_records_the_kernel_choice(environ):
    from taskgeom.report.manifest import machine

    kernels.use_portable_kernels(native=True)
    assert machine()["kernels"] == "native"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_workers_default_to_the_cores_of_a_restricted_affinity_mask():
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert usable_cores() == 1 and default_workers() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert usable_cores() <= len(before) and default_workers(threads_per_run=len(before)) == max(
        1, usable_cores() // len(before)
    )


def test_a_cgroup_quota_bounds_the_usable_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # one and a half CPUs
    assert usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == usable_cores("/nonexistent")


def test_the_schedule_runs_no_more_at_once_than_memory_allows(tmp_path):
    from conftest import tiny_config

    from taskgeom.experiments.schedule import TrainTask, Unit, memory_workers
    from taskgeom.training.memory import training_memory

    config = tiny_config()
    units = [Unit(TrainTask(config, str(tmp_path), "cpu", "none", 1), 1, 0) for _ in range(4)]
    need = sum(training_memory(config).values())
    assert memory_workers(units, available=int(2.5 * need)) == 2
    assert memory_workers(units, available=need // 2) == 1
    assert (
        memory_workers(units, available=100 * need) == 100
    )  # the schedule takes the least of this, the cores and the group


def test_the_estimate_spreads_the_pool_over_the_workers_but_never_below_its_longest_unit_then_adds_the_main_process():
    from taskgeom.training.timing import estimate_wall

    assert estimate_wall([40.0, 20.0, 20.0], 7.0, workers=2) == pytest.approx(80 / 2 + 7)
    assert estimate_wall([40.0, 20.0, 20.0], 0.0, workers=8) == pytest.approx(40)  # the longest unit
    assert estimate_wall([], 0.0, workers=2) == 0


def test_the_plan_counts_only_the_work_left(tiny_reproduction, tmp_path):
    """On the folder of a finished reproduction nothing is left to train, analyse or measure; on an
    empty folder everything is, and each part's CPU seconds are its kind's cost per training
    FLOP-second (analyses scaled by the blocks)."""
    from conftest import SMOKE, TINY_SEEDS

    from taskgeom.claims.registry import experiment
    from taskgeom.experiments.base import Context
    from taskgeom.experiments.executors import Executor
    from taskgeom.experiments.request import Request, resolve, work_left
    from taskgeom.training.timing import TRAIN_COST_PER_FLOP_SECOND, depth_factor

    def left(out):
        request = Request(SMOKE, TINY_SEEDS, out)
        resolved = resolve(request)
        ctx = Context(
            resolved.out, SMOKE, TINY_SEEDS, Executor("local", 2), "cpu", "none", resolved.settings, resolved.studies
        )
        return work_left(ctx, resolved.experiments, rate=1e9)

    done = left(tiny_reproduction)
    assert done.attrs["left"] == ["m1", "dual_modes", "e4"]
    assert not done["train"].any() and not done[["m1", "dual_modes", "e4"]].any().any()
    assert (done["cpu_pool_s"] == 0).all() and (done["cpu_main_s"] == 0).all()

    fresh = left(tmp_path / "fresh")
    assert fresh["train"].all() and fresh["m1"].sum() == 3 * len(TINY_SEEDS)  # the k = -1 runs of E1, E2, E3
    e4 = fresh[fresh["e4"] > 0]  # E4's k = -1 run of each seed, one measurement each
    assert set(e4["recipe"]) == {"e4"} and set(e4["diversity"]) == {-1} and e4["e4"].sum() == len(TINY_SEEDS)
    # its measurement beside the training on the pool, as M1's and the dual analyses: nothing left for this process
    e4_cost = TRAIN_COST_PER_FLOP_SECOND + experiment("e4").cost * depth_factor(1)
    assert list(e4["cpu_pool_s"]) == pytest.approx(list(e4_cost * e4["flops"] / 1e9))
    assert (fresh["cpu_main_s"] == 0).all()
    assert fresh["dual_modes"].sum() == 2 * 3 * len(TINY_SEEDS)  # the sweep at quick: E1 and E3 on the grid -1, 4, 10
    one = fresh[(fresh["dual_modes"] > 0) & (fresh["m1"] == 0)].iloc[0]
    depth = depth_factor(1)  # the smoke profile: one block
    dual = experiment("dual_modes").cost
    assert one["cpu_pool_s"] == pytest.approx((TRAIN_COST_PER_FLOP_SECOND + dual * depth) * one["flops"] / 1e9)


def test_the_probe_counts_a_matrix_multiplys_flops_per_cpu_second_of_the_process(monkeypatch):
    """One call of n x n @ n x n is 2 n^3 FLOPs: with a wall clock that advances 1 s per reading, a
    3.5 s probe multiplies 3 times (after the readings 1, 2, 3) and stops at the reading 4; the rate
    divides by the CPU seconds the process got meanwhile (here 0.5: a machine busy with other work),
    not by the wall seconds."""
    from taskgeom.training import timing

    ticks, cpu = iter(range(10_000)), iter([10.0, 10.5])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(ticks)))
    monkeypatch.setattr(timing.time, "process_time", lambda: next(cpu))
    assert timing.matmul_rate(seconds=3.5, n=8) == pytest.approx(3 * 2 * 8**3 / 0.5)


def test_the_plan_prints_its_wall_time_on_this_machine_with_the_probe(environ):
    result = _run()
    assert result.exit_code == 0, result.output
    assert (
        "estimated wall time here:" in result.output
        and "GFLOP/s a thread" in result.output
        and "usable cores" in result.output
    )


# The weights of 20 steps of the quick E1 recipe under the portable kernels (ATen, MKL and oneDNN at
# AVX2), as published: torch 2.13.0, measured on a 2-core AMD EPYC (AVX2) at the commit that added this
# test. A change of the recipe, the model, the sampler, the trainer, or of torch's kernels changes it:
# then the published manifests (docs/results) no longer match what a user trains, and must be measured
# again with the new value written here.
PUBLISHED_TINY_E1 = "b56deee82890b67ff404befe70fa43dc21c36574aa332946517d47abde497de6"
# The pins were shown to hold across AMD EPYC machines with AVX2 and with AVX-512. On an Intel Xeon
# (AVX-512, 2026-12-03) the same pins train other bits (c50a11ad9a63...; MKL_CBWR=AVX2,STRICT and
# COMPATIBLE give others again): the published bits are AMD's, and an Intel CPU is told so.
PUBLISHED_VENDOR = "AuthenticAMD"


def _cpu_vendor() -> str | None:
    for line in (
        Path("/proc/cpuinfo").read_text(errors="replace").splitlines() if Path("/proc/cpuinfo").is_file() else []
    ):
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return None


def test_a_short_quick_e1_training_gives_the_published_bits(tmp_path):
    import hashlib

    from safetensors.torch import load_file

    from taskgeom.runs.folders import Run
    from taskgeom.settings.recipes import load_recipe
    from taskgeom.training.train import train

    if os.environ.get(kernels.CHOICE_VARIABLE) != "pinned":
        pytest.skip("the published bits need the portable kernels, which this CPU cannot hold")
    if _cpu_vendor() != PUBLISHED_VENDOR:
        pytest.skip(
            f"the published bits were trained on {PUBLISHED_VENDOR} CPUs; this one is {_cpu_vendor()}, where the pins give other bits"
        )
    config = load_recipe(
        "e1",
        "quick",
        [
            "train.steps=20",
            "train.eval_every=20",
            "train.checkpoint_every=20",
            "train.snapshots=0",
            "train.eval_batch=16",
        ],
    )
    run = Run.create(config, tmp_path)
    train(run, device="cpu")
    tensors, digest = load_file(run.model_path), hashlib.sha256()
    for name in sorted(tensors):  # the tensors' bytes, not the file's (whose header may order them otherwise)
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    assert digest.hexdigest() == PUBLISHED_TINY_E1
