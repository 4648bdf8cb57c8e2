"""Shared fixtures: tiny configs that train in seconds, the tiny reproduction, and headless Chromium
for the tests marked ``browser``."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from taskgeom.settings.config import RunConfig
from taskgeom.settings.kernels import use_portable_kernels
from taskgeom.settings.recipes import build_config

# The kernels the CLI would choose, before any test computes: in-process runs and the pool workers
# and Ray tasks the tests start then train the same bits.
use_portable_kernels()
torch.set_num_threads(1)


def tiny_config(family: str = "dice", **train) -> RunConfig:
    """A 1-layer, 16-wide model on short sequences; ``train`` overrides train settings."""
    raw = {
        "name": f"tiny-{family}",
        "task": {"family": family, "seq_len": 16},
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 16},
        "train": {
            "steps": 40,
            "batch_size": 8,
            "eval_every": 10,
            "checkpoint_every": 10,
            "eval_batch": 16,
            "lr": 3e-3,
            "threads": 1,
        }
        | train,
    }
    return build_config(raw)


def two_block_run(folder, family: str, seq_len: int):
    """A finished 2-block, 16-wide model of ``family`` (4 symbols) trained 30 steps in ``folder``, opened for study."""
    from taskgeom.analysis.study import StudyRun
    from taskgeom.runs.folders import Run
    from taskgeom.training.train import train

    config = build_config(
        {
            "name": f"two-block-{family}",
            "task": {"family": family, "seq_len": seq_len, "vocab_size": 4},
            "model": {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": seq_len},
            "train": {
                "steps": 30,
                "batch_size": 16,
                "eval_every": 30,
                "checkpoint_every": 30,
                "eval_batch": 16,
                "lr": 3e-3,
                "threads": 1,
            },
        }
    )
    run = Run.create(config, folder)
    train(run)
    return StudyRun(Run.open(run.path))


def planted_paths(gen: torch.Generator, groups: int, K: int, D: int, T: int):
    """Planted M1 geometry: centred theta [K, D]; mu [T, D], constant over the late window; beta
    [groups * K, T, K] on the simplex, each group of K sequences sharing one Dirichlet path rolled so
    sequence k leans to task k, one-hot on its task over the late window; task [groups * K]."""
    from taskgeom.analysis.measures.task_vectors import late_window

    theta = torch.randn(K, D, generator=gen, dtype=torch.float64)
    theta -= theta.mean(0)
    window = late_window(T)
    mu = torch.randn(T, D, generator=gen, dtype=torch.float64)
    mu[window] = mu[window.start]
    gamma = torch._standard_gamma(torch.ones(groups, T, K, dtype=torch.float64), gen)
    base = gamma / gamma.sum(-1, keepdim=True)  # [G, T, K]
    base[:, window] = torch.eye(K, dtype=torch.float64)[0]
    beta = torch.stack([base.roll(k, dims=-1) for k in range(K)], 1).reshape(-1, T, K)  # [G*K, T, K]
    return theta, mu, beta, torch.arange(K).repeat(groups), window


@pytest.fixture
def tiny():
    return tiny_config


# Every run of a reproduction shrunk to seconds: what the report, browser and README tests read.
SMOKE = (
    "smoke"  # the profile every recipe shares that runs every experiment at toy sizes (configs/shared/profiles.yaml)
)
TINY_SEEDS = (0, 1)


@pytest.fixture(scope="session")
def tiny_reproduction(tmp_path_factory):
    """The results folder of a whole ``reproduce`` (every experiment) at the ``smoke`` profile on two
    seeds: about two minutes on 2 cores. Tests must not modify it (copy it)."""
    from taskgeom.experiments import reproduce
    from taskgeom.experiments.executors import Executor

    out = tmp_path_factory.mktemp("tiny-reproduction")
    reproduce(out, SMOKE, None, Executor("local", 2), device="cpu", seeds=TINY_SEEDS)
    return out


# Headless Chromium (Debian's chromium and chromium-driver, which .ci/run installs) for the tests marked
# ``browser``: skipped where no ChromeDriver is installed, unless TASKGEOM_REQUIRE_BROWSER=1 (set by .ci/run).
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# As root and on a machine with no network, Chromium needs these to start quietly.
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1300,1800",
)


def pytest_collection_modifyitems(config, items):
    if (CHROMIUM and DRIVER) or os.environ.get("TASKGEOM_REQUIRE_BROWSER") == "1":
        return
    skip = pytest.mark.skip(
        reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
    )
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium driver (selenium), logging the page's console."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()
