"""The family registry (issue 21): the shipped families are registered like any other; a family
from another package joins through the entry-point group ``taskgeom.families`` in every process
that reads a config; a name registered twice, or a plugin that fails to import, ends the command
with one line naming the package. Plugins here are fake distributions (a ``*.dist-info`` folder
with ``entry_points.txt``) on ``PYTHONPATH``, so each test runs taskgeom in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from taskgeom import tasks
from taskgeom.settings.fields import TaskSettings
from taskgeom.settings.recipes import build_config

# A family of its own: E3's chains under another name, with one setting of its own.
PLUGIN = """
from pydantic import Field
from taskgeom.settings.fields import Int, TokenTaskSettings
from taskgeom.tasks.markov import Markov

class ChainSettings(TokenTaskSettings):
    vocab_size: Int = Field(5, ge=2)

class Chain(Markov):
    name = "{name}"
    Settings = ChainSettings

    def __init__(self, vocab_size):
        super().__init__(vocab_size, alpha=1.0)
"""


def plugin(root: Path, package: str, entry: str, source: str) -> dict:
    """Install module ``package`` (``source``) as a distribution declaring ``entry`` in the group;
    returns the environment that finds it."""
    (root / f"{package}.py").write_text(source)
    info = root / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[taskgeom.families]\n{entry}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def run(env: dict, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def taskgeom(env: dict, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "taskgeom"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_shipped_families_are_registered_with_their_settings_models():
    for name in ("dice", "markov", "regression", "dyck"):
        family = tasks.family_class(name)
        assert issubclass(family.Settings, TaskSettings)
        model = tasks.settings_model(name)
        assert model.model_fields["family"].default == name
        assert build_config({"name": "x", "task": {"family": name}}).task.family == name
    with pytest.raises(tasks.FamilyError, match="unknown task family 'nosuch'; registered: dice, dyck, ") as err:
        tasks.family_class("nosuch")
    assert "markov, regression" in str(err.value) and "entry-point group taskgeom.families" in str(err.value)


def test_registering_a_name_twice_is_refused():
    class Twin(tasks.Dice):
        name = "dice"

    with pytest.raises(tasks.FamilyError, match="family 'dice' is registered twice: by taskgeom and by tests"):
        tasks.register(Twin, "tests")


def test_a_plugin_family_validates_builds_and_trains(tmp_path):
    env = plugin(tmp_path, "chainfam", "chain = chainfam:Chain", PLUGIN.format(name="chain"))
    done = run(
        env,
        "from taskgeom.settings.config import ConfigError\nfrom taskgeom.settings.recipes import build_config\n"
        "c = build_config({'name': 'x', 'task': {'family': 'chain', 'seq_len': 8}})\n"
        "print(type(c.family).__name__, c.family.vocab_size, c.task.vocab_size, c.digest())\n"
        "try:\n    build_config({'name': 'x', 'task': {'family': 'chain', 'alpha': 2.0}})\n"
        "except ConfigError as err:\n    print(err)\n",
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first.split()[:3] == ["Chain", "5", "5"]
    assert second == "unknown config field 'task.alpha'"
    recipe = tmp_path / "chain.yaml"
    recipe.write_text(
        "base: {name: chain, task: {family: chain, seq_len: 8}, model: {n_layers: 1, d_model: 16, n_heads: 2, d_mlp: 32, "
        "max_len: 8}, train: {steps: 4, batch_size: 4, eval_every: 4, checkpoint_every: 4, eval_batch: 8}}\nprofiles: {quick: {}}\n"
    )
    trained = taskgeom(env, "train", str(recipe), "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    (run_dir,) = [path for path in (tmp_path / "runs").iterdir() if path.is_dir()]
    assert (run_dir / "model.safetensors").is_file() and "family: chain" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize(
    "entry,source,message",
    [
        (
            "dice = dupfam:Chain",
            PLUGIN.format(name="dice"),
            "error: family 'dice' is registered twice: by taskgeom and by package dupfam (entry point dice = dupfam:Chain); uninstall one of them",
        ),
        (
            "broken = dupfam:Chain",
            "raise ImportError('no module named hmmlearn')\n",
            "error: package dupfam (entry point broken = dupfam:Chain) failed to import: ImportError: no module named hmmlearn",
        ),
        (
            "other = dupfam:Chain",
            PLUGIN.format(name="chain"),
            "error: package dupfam (entry point other = dupfam:Chain): the entry point's name must be the family's name ('chain')",
        ),
    ],
)
def test_a_bad_plugin_ends_every_command_with_one_line_naming_its_package(tmp_path, entry, source, message):
    env = plugin(tmp_path, "dupfam", entry, source)
    done = taskgeom(env, "train", "e1", "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == message + "\n"
    assert not (tmp_path / "runs").exists()
