"""The CLI's error contract (issue 12): every bad input below ends with its exit code (2 bad input,
3 the environment refused, 1 training diverged), one line on stderr and no traceback, and leaves
every file already there as it was (bytes and modification time) and no new one."""

from __future__ import annotations

import errno
import socket
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from taskgeom.cli import app, classify
from taskgeom.errors import (
    AnalysisError,
    CheckpointError,
    EnvironmentRefused,
    RunDirError,
    RunLockedError,
    TrainingDiverged,
)
from taskgeom.runs.folders import Run
from taskgeom.training.memory import analysis_memory, format_bytes

RECIPE = "base: {name: r, task: {family: dice, seq_len: 16}, model: {n_layers: 1, d_model: 16, n_heads: 2, d_mlp: 32, max_len: 16}}\n"


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root``: (kind, bytes, mtime in ns) of files, ("dir",) of folders."""
    return {
        str(p.relative_to(root)): ("file", p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else ("dir",)
        for p in sorted(root.rglob("*"))
    }


def invoke(args: list) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(root: Path, args: list[str], code: int, message: str | None = None, starts: str | None = None):
    """Run ``args`` in ``root``; check the exit code, one line on stderr (``message`` exactly, or
    starting with ``starts``), nothing on stdout, and every file under ``root`` unchanged."""
    before = snapshot(root)
    result = invoke(args)
    assert result.exit_code == code, (result.exit_code, result.output)
    assert "Traceback" not in result.output and result.stdout == ""
    line = result.stderr
    assert line.endswith("\n") and line.count("\n") == 1, line
    if message is not None:
        assert line == f"error: {message}\n"
    if starts is not None:
        assert line.startswith(f"error: {starts}"), line
    assert snapshot(root) == before
    return line


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("TASKGEOM_DEBUG", raising=False)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """A folder holding a valid recipe, a regular file and a results folder with one file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.yaml").write_text(RECIPE + "profiles: {quick: {train: {steps: 2}}}\n")
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("already here\n")
    return tmp_path


# ---- recipes and overrides: exit 2 -------------------------------------------------------------
@pytest.mark.parametrize(
    "profiles, message",
    [
        ("[quick]", "'profiles' must be a mapping of profile names to settings, got a list"),
        ("{quick: 5}", "profiles.quick must be a mapping of settings, got the int 5"),
        ("{quick: [1, 2]}", "profiles.quick must be a mapping of settings, got a list"),
    ],
)
def test_recipe_whose_profiles_are_not_mappings(root, profiles, message):
    (root / "bad.yaml").write_text(RECIPE + f"profiles: {profiles}\n")
    refused(root, ["train", "bad.yaml", "--out", "out"], 2, f"bad.yaml: {message}")


def test_recipe_base_that_is_not_a_mapping(root):
    (root / "bad.yaml").write_text("base: [1]\nprofiles: {quick: {}}\n")
    refused(
        root, ["train", "bad.yaml", "--out", "out"], 2, "bad.yaml: 'base' must be a mapping of settings, got a list"
    )


def test_recipe_that_is_not_utf8(root):
    (root / "latin.yaml").write_bytes(RECIPE.encode() + b"# caf\xe9\nprofiles: {quick: {}}\n")
    offset = len(RECIPE.encode()) + len(b"# caf")
    refused(
        root,
        ["train", "latin.yaml", "--out", "out"],
        2,
        f"latin.yaml: not UTF-8 text (byte 0xe9 at offset {offset}); save the recipe as UTF-8",
    )


def test_recipe_that_is_not_yaml_is_one_line(root):
    (root / "broken.yaml").write_text("base: {name: [\nprofiles: {}\n")
    refused(root, ["train", "broken.yaml", "--out", "out"], 2, starts="broken.yaml: not valid YAML (")


def test_override_that_is_not_yaml(root):
    refused(
        root,
        ["train", "ok.yaml", "--out", "out", "--set", "train.steps=[1"],
        2,
        "override 'train.steps=[1': the value is not valid YAML (expected ',' or ']', but got '<stream end>' at line 1, column 3)",
    )


@pytest.mark.parametrize(
    "value",
    ["!!python/object/apply:os.system ['touch pwned']", "!!binary AAAA", "!!float 1", "[1, !!str 2]", "!local x"],
)
def test_override_with_a_yaml_tag(root, value):
    refused(
        root,
        ["train", "ok.yaml", "--out", "out", "--set", f"train.steps={value}"],
        2,
        f"override {'train.steps=' + value!r}: YAML tags (!...) are not allowed in a value; write the plain value",
    )
    assert not (root / "pwned").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=true", "config field 'train.steps': Input should be a valid integer (got True)"),
        ("train.steps=2.0", "config field 'train.steps': Input should be a valid integer (got 2.0)"),
        ("train.batch_size='8'", "config field 'train.batch_size': Input should be a valid integer (got '8')"),
        ("train.lr=.inf", "config field 'train.lr': Input should be a finite number (got inf)"),
        ("train.lr=.nan", "config field 'train.lr': Input should be a finite number (got nan)"),
        ("train.lr=true", "config field 'train.lr': Input should be a number, not a boolean (got True)"),
    ],
)
def test_counts_are_integers_and_rates_finite(root, override, message):
    refused(root, ["train", "ok.yaml", "--out", "out", "--set", override], 2, message)


def test_disjoint_majors_need_enough_faces(root):
    refused(
        root,
        ["train", "ok.yaml", "--out", "out", "--set", "task.vocab_size=2", "--set", "task.n_major=5"],
        2,
        "task.majors disjoint gives each major task faces of its own: task.n_major (5) must not exceed task.vocab_size (2); "
        "raise task.vocab_size or set task.majors=prior",
    )


# ---- paths: exit 2 -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["--out", "afile"], "--out afile is a file, not a folder"),
        (["--out", "afile/sub"], "--out afile/sub: afile is a file, not a folder"),
        (["--run-dir", "afile"], "--run-dir afile is a file, not a folder"),
        (["--run-dir", "afile/run"], "--run-dir afile/run: afile is a file, not a folder"),
    ],
)
def test_train_into_a_regular_file(root, args, message):
    refused(root, ["train", "ok.yaml", *args], 2, message)


@pytest.mark.parametrize("command", [["sweep", "ok.yaml", "--seeds", "0", "--diversity", "-1"], ["reproduce"]])
def test_sweep_and_reproduce_into_a_regular_file(root, command):
    refused(root, [*command, "--out", "afile/results"], 2, "--out afile/results: afile is a file, not a folder")


def test_export_hf_to_a_path_under_a_file(root, tiny):
    run = Run.create(tiny(), root / "out")
    refused(root, ["export-hf", run.path, "afile/hf"], 2, "OUT afile/hf: afile is a file, not a folder")


# ---- sweep options: exit 2 -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "seeds, message",
    [
        ("", "--seeds must name at least one integer, got ''"),
        (" , ", "--seeds must name at least one integer, got ' , '"),
        ("0,1,0", "--seeds names 0 more than once, got '0,1,0'"),
        ("0,x", "--seeds must be comma-separated integers, got '0,x'"),
    ],
)
def test_sweep_seeds(root, seeds, message):
    refused(root, ["sweep", "ok.yaml", "--seeds", seeds, "--diversity", "-1", "--out", "out"], 2, message)


# ---- memory: exit 3, with the estimate, before anything is made --------------------------------
def test_a_model_too_large_for_the_machine(root):
    line = refused(
        root,
        ["train", "ok.yaml", "--out", "out", "--set", "model.d_model=1000000", "--device", "cpu"],
        3,
        starts="training r (",
    )
    assert "TiB (weights " in line and "of memory available on this machine (cpu); reduce model.d_model" in line


def test_the_memory_message_gives_the_estimate_against_the_machine(root, monkeypatch):
    monkeypatch.setattr("taskgeom.settings.devices.available_memory", lambda device: 2**20)
    refused(
        root,
        ["train", "ok.yaml", "--out", "out", "--set", "train.batch_size=4096", "--device", "cpu"],
        3,
        starts="training r (",
    )
    monkeypatch.setattr("taskgeom.settings.devices.available_memory", lambda device: 2**40)
    result = invoke(["train", "ok.yaml", "--out", "out", "--device", "cpu"])
    assert result.exit_code == 0, result.output


def test_analyze_too_many_sequences_is_refused_before_any_work(root, tiny, monkeypatch):
    run = Run.create(tiny(), root / "out")
    (run.path / "model.safetensors").write_bytes(b"never read")  # marks the run finished; loading it would fail
    monkeypatch.setattr("taskgeom.analysis.stored.m1.analyze", lambda *a, **k: pytest.fail("the analysis started"))
    monkeypatch.setattr("taskgeom.settings.devices.available_memory", lambda device: 8 * 2**30)
    need = format_bytes(analysis_memory(run.config, 100_000_000))
    refused(
        root,
        ["analyze", run.path, "--sequences", "100000000"],
        3,
        f"analysing 100000000 sequences per batch of tiny-dice needs at least {need}, more than the 8.0 GiB of memory "
        "available on this machine (cpu); ask for fewer with --sequences",
    )


def test_analyze_too_many_sequences_against_this_machine(root, tiny, monkeypatch):
    run = Run.create(tiny(), root / "out")
    (run.path / "model.safetensors").write_bytes(b"never read")
    monkeypatch.setattr("taskgeom.analysis.stored.m1.analyze", lambda *a, **k: pytest.fail("the analysis started"))
    refused(
        root,
        ["analyze", run.path, "--sequences", "100000000"],
        3,
        starts="analysing 100000000 sequences per batch of tiny-dice needs at least",
    )


# ---- Ray: checked before any training ------------------------------------------------------------
@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if reproduce's experiments or a sweep's runs start."""
    import taskgeom.experiments
    import taskgeom.experiments.sweep

    monkeypatch.setattr(
        taskgeom.experiments, "reproduce", lambda *a, **k: pytest.fail("reproduce started its experiments")
    )
    monkeypatch.setattr(taskgeom.experiments.sweep, "run_sweep", lambda *a, **k: pytest.fail("the sweep started"))


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("command", [["reproduce"], ["sweep", "ok.yaml", "--diversity", "-1", "--seeds", "0"]])
def test_ray_missing_is_refused_before_any_training(root, monkeypatch, no_training, command):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    refused(
        root,
        [*command, "--out", "out", "--executor", "ray", "--device", "cpu"],
        2,
        "the Ray executor needs `pip install taskgeom[ray]`",
    )


@pytest.mark.parametrize("command", [["reproduce"], ["sweep", "ok.yaml", "--diversity", "-1", "--seeds", "0"]])
def test_ray_unreachable_is_refused_before_any_training(root, monkeypatch, no_training, command):
    monkeypatch.setitem(sys.modules, "ray", type(sys)("ray"))  # importable whether or not the extra is installed
    port = _closed_port()
    line = refused(
        root,
        [*command, "--out", "out", "--executor", "ray", "--address", f"127.0.0.1:{port}", "--device", "cpu"],
        3,
        starts=f"no Ray cluster answers at 127.0.0.1:{port} (",
    )
    assert "refused" in line.lower()


def test_ray_address_that_is_not_host_port(root, no_training):
    refused(
        root,
        ["reproduce", "--out", "out", "--executor", "ray", "--address", "nohost"],
        2,
        "--address 'nohost' must look like HOST:PORT (or ray://HOST:PORT, or auto)",
    )


# ---- the general mechanism: every exception is an exit code and one line -------------------------
@pytest.mark.parametrize(
    "err, code",
    [
        (TrainingDiverged("train.lr: loss is nan at step 3"), 1),
        (RunDirError("x"), 2),
        (CheckpointError("x"), 2),
        (AnalysisError("x"), 2),
        (RunLockedError("x"), 2),
        (EnvironmentRefused("x"), 3),
        (OSError(errno.EACCES, "Permission denied", "runs/a"), 3),
        (OSError(errno.EPERM, "Operation not permitted", "runs/a"), 3),
        (OSError(errno.EROFS, "Read-only file system", "runs/a"), 3),
        (OSError(errno.ENOSPC, "No space left on device", "runs/a"), 3),
        (OSError(errno.EDQUOT, "Disk quota exceeded", "runs/a"), 3),
        (MemoryError(), 3),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 51200000000 bytes."), 3),
        (ConnectionError("ray: GCS unreachable"), 3),
        (OSError(errno.ENOTDIR, "Not a directory", "afile/x"), 2),
        (KeyError("status"), 4),
    ],
)
def test_classify(err, code):
    assert classify(err)[0] == code


@pytest.mark.parametrize(
    "err, code, message",
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "out/r/config.yaml"),
            3,
            "out/r/config.yaml: No space left on device",
        ),
        (PermissionError(errno.EACCES, "Permission denied", "out/r"), 3, "out/r: Permission denied"),
        (MemoryError(), 3, "out of memory"),
        (
            TrainingDiverged("training diverged at step 3: the loss is nan; run marked diverged"),
            1,
            "training diverged at step 3: the loss is nan; run marked diverged",
        ),
        (
            RunLockedError("out/r is being written by process 42 (lock out/r/.lock)"),
            2,
            "out/r is being written by process 42 (lock out/r/.lock)",
        ),
        (
            ValueError("a bug\nover two lines"),
            4,
            "internal error (ValueError: a bug over two lines); this is a bug in taskgeom: "
            "rerun with --debug and report the traceback",
        ),
    ],
)
def test_any_error_of_a_command_is_one_line_and_its_code(root, monkeypatch, err, code, message):
    def fail(*args, **kwargs):
        raise err

    monkeypatch.setattr("taskgeom.runs.folders.Run.create", fail)
    refused(root, ["train", "ok.yaml", "--out", "out"], code, message)


def test_debug_adds_the_traceback(root, monkeypatch):
    (root / "bad.yaml").write_text(RECIPE + "profiles: [quick]\n")
    message = "error: bad.yaml: 'profiles' must be a mapping of profile names to settings, got a list\n"
    for args, env in ((["--debug"], {}), ([], {"TASKGEOM_DEBUG": "1"})):
        result = CliRunner().invoke(app, [*args, "train", "bad.yaml"], env=env)
        assert result.exit_code == 2
        assert result.stderr.startswith("Traceback (most recent call last):") and result.stderr.endswith(message)
    result = CliRunner().invoke(app, ["train", "bad.yaml"], env={"TASKGEOM_DEBUG": "0"})
    assert result.exit_code == 2 and result.stderr == message


def test_run_dir_does_not_need_out(root):
    """--out is not used when --run-dir is given, so a file of that name does not matter."""
    result = invoke(["train", "ok.yaml", "--out", "afile", "--run-dir", "out/mine", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert (root / "out" / "mine" / "model.safetensors").is_file() and (root / "afile").read_text() == "not a folder\n"


def test_on_a_gpu_memory_is_checked_against_the_gpus(root, monkeypatch):
    """No GPU needed: torch's CUDA queries are stood in for; the model's part is checked against the
    GPU's free memory, the exact posterior (made on the CPU) against the host's."""
    import torch

    from taskgeom.settings.devices import available_memory

    monkeypatch.setattr("taskgeom.settings.devices.resolve_device", lambda name: torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    assert available_memory(torch.device("cuda:0")) == 2**20
    line = refused(root, ["train", "ok.yaml", "--out", "out", "--device", "cuda"], 3, starts="training r (")
    assert line.endswith(
        "more than the 1.0 MiB of memory available on cuda:0 (Fake GPU); reduce model.d_model, model.d_mlp, model.n_layers, "
        "task.seq_len, train.batch_size, train.eval_batch or task.diversity\n"
    )
    assert "(weights " in line and "bayes" not in line


def test_available_memory_of_this_machine():
    import os

    import torch

    from taskgeom.settings.devices import available_memory, describe

    free = available_memory(torch.device("cpu"))
    assert 0 < free <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert describe(torch.device("cpu")) == "this machine (cpu)"


def test_a_sweep_of_fewer_than_two_major_tasks_is_refused_before_any_training(root):
    """Its task vectors span no subspace, so every run's analysis would fail after training."""
    refused(
        root,
        ["sweep", "ok.yaml", "--set", "task.n_major=1", "--diversity", "-1,2", "--seeds", "0", "--out", "out"],
        2,
        "sweep of ok.yaml (k = -1, seed 0): the task subspace needs at least 2 major tasks (task.n_major), got 1",
    )


def test_a_reproduction_of_fewer_than_two_major_tasks_is_refused_before_any_training(root):
    refused(
        root,
        ["reproduce", "--set", "task.n_major=1", "--out", "out", "--device", "cpu"],
        2,
        starts="reproduce (e1, k = -1): the task subspace needs at least 2 major tasks (task.n_major), got 1",
    )


def test_a_sweep_whose_every_run_failed_lists_them_and_exits_1(root):
    result = invoke(
        [
            "sweep",
            "ok.yaml",
            "--set",
            "train.lr=1e30",
            "--set",
            "train.eval_every=1",
            "--diversity",
            "-1",
            "--seeds",
            "0",
            "--workers",
            "1",
            "--out",
            "sw",
        ]
    )
    assert result.exit_code == 1, result.output
    assert "failed" in result.stdout and "TrainingDiverged" in result.stdout and "Traceback" not in result.output
    assert result.stdout.strip().endswith(f"tables: {Path('sw') / 'sweep.csv'}")  # no by_step.csv: no run finished
    assert (root / "sw" / "sweep.csv").is_file() and not (root / "sw" / "by_step.csv").exists()
