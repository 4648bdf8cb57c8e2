"""Device choice and mixed precision: names resolve or fail clearly, batches keep their data on
the way to a device, bf16 autocast engages and stays close to fp32, and (where a GPU exists) a
CUDA run matches the CPU run."""

from __future__ import annotations

from collections import Counter
from dataclasses import fields

import pytest
import torch
from conftest import tiny_config
from typer.testing import CliRunner

from taskgeom.cli import app
from taskgeom.runs.folders import Run
from taskgeom.settings.devices import DeviceError, autocast, resolve_device, to_device
from taskgeom.tasks import Batch, make
from taskgeom.training.train import train

runner = CliRunner()

# Final held-out losses of a bf16-autocast run against the fp32 run of the same seed (nats). The
# evaluation itself runs in fp32, so only the weights' 40-step trajectories differ; we observed
# differences of 3e-6 on the tiny config, against 0.6 nats learned over the run.
BF16_TOLERANCE = 1e-3
# A CUDA fp32 run against the CPU run: same data and initial weights, different reduction orders.
CUDA_TOLERANCE = 1e-3


def test_auto_picks_cuda_only_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.parametrize("name", ["tpu", "cpu:1", "cuda:x", "gpu", "auto:", "cpu:", "cuda:"])
def test_unknown_device_names_are_refused(name):
    with pytest.raises(DeviceError, match="choose auto, cpu, cuda or cuda:N"):
        resolve_device(name)


def test_cli_refuses_a_bad_device_before_making_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(app, ["train", "e1", "--device", "cuda", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "CUDA is not available" in result.output
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("family", ["dice", "regression"])
def test_batches_keep_their_tensors_on_the_way_to_a_device(family):
    """Every tensor a batch holds reaches the device with its shape and dtype, and the batch it came
    from stays on the CPU. The "meta" device stands in for an accelerator: a tensor left behind, or
    moved in place, would still be on the CPU."""
    fam = make(family)
    batch = fam.sample(fam.sample_pool(2, 0), 4, 12, seed=0)
    moved = batch.to(torch.device("meta"))
    held = [f.name for f in fields(Batch) if getattr(batch, f.name) is not None]
    assert held == (["tokens", "task", "params"] if family == "dice" else ["tokens", "task", "params", "x", "y"])
    for f in fields(Batch):
        before, after = getattr(batch, f.name), getattr(moved, f.name)
        assert (before is None) == (after is None), f.name
        if before is not None:
            assert after.device.type == "meta", f.name
            assert (after.shape, after.dtype) == (before.shape, before.dtype), f.name
            assert before.device.type == "cpu", f.name


class _FakeTensor:
    """Records the transfer calls ``to_device`` makes; no CUDA needed."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def pin_memory(self) -> "_FakeTensor":
        self.calls.append(("pin_memory", self.name))
        return _FakeTensor(f"{self.name}+pinned", self.calls)

    def to(self, device, non_blocking: bool = False) -> "_FakeTensor":
        self.calls.append(("to", self.name, device, non_blocking))
        return _FakeTensor(f"{self.name}@{device}", self.calls)


def test_cuda_transfers_go_through_pinned_memory_without_blocking():
    """To CUDA: pin first, then an asynchronous copy of the pinned tensor; to the CPU: a plain copy."""
    calls: list = []
    cuda = torch.device("cuda", 0)  # a device object needs no CUDA
    out = to_device(_FakeTensor("t", calls), cuda)
    assert calls == [("pin_memory", "t"), ("to", "t+pinned", cuda, True)] and out.name == "t+pinned@cuda:0"
    calls.clear()
    to_device(_FakeTensor("t", calls), torch.device("cpu"))
    assert calls == [("to", "t", torch.device("cpu"), False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["dice", "regression"])
def test_batches_arrive_on_cuda_with_their_values(family):
    fam = make(family)
    batch = fam.sample(fam.sample_pool(2, 0), 4, 12, seed=0)
    moved = batch.to(torch.device("cuda"))
    torch.cuda.synchronize()
    for f in fields(Batch):
        before, after = getattr(batch, f.name), getattr(moved, f.name)
        if before is not None:
            assert after.device.type == "cuda" and torch.equal(before, after.cpu()), f.name


def test_bf16_autocast_engages_only_when_asked():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with autocast(torch.device("cpu"), "bf16"):
        assert layer(x).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert layer(x).dtype == torch.float32


def test_bf16_training_stays_close_to_fp32(tmp_path):
    fp32 = Run.create(tiny_config("dice"), path=tmp_path / "fp32")
    bf16 = Run.create(tiny_config("dice", precision="bf16"), path=tmp_path / "bf16")
    a, b = train(fp32, device="cpu"), train(bf16, device="cpu")
    assert a["device"] == b["device"] == "cpu"
    losses = [(a["eval"][s]["loss"], b["eval"][s]["loss"]) for s in ("major", "ood")]
    assert all(x != y for x, y in losses), "bf16 autocast changed nothing: it did not engage"
    assert all(abs(x - y) < BF16_TOLERANCE for x, y in losses), losses
    for name, tensor in bf16.load_model().state_dict().items():  # weights stay float32
        assert tensor.dtype == torch.float32, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_matches_the_cpu_run(tmp_path):
    cpu = train(Run.create(tiny_config("dice"), path=tmp_path / "cpu"), device="cpu")
    cuda = train(Run.create(tiny_config("dice"), path=tmp_path / "cuda"), device="cuda")
    assert cuda["device"].startswith("cuda")
    for set_name, metrics in cpu["eval"].items():
        for metric, value in metrics.items():
            assert cuda["eval"][set_name][metric] == pytest.approx(value, abs=CUDA_TOLERANCE), (set_name, metric)


def test_training_sends_every_batch_and_evaluation_set_to_its_device(tmp_path, monkeypatch):
    """The trainer copies each step's batch and each held-out set to the resolved device (CPU here;
    the same calls carry them to CUDA, through pinned memory)."""
    import taskgeom.tasks.base as base

    moved = []

    def spy(tensor, device):
        moved.append((tuple(tensor.shape), device))
        return tensor.to(device)

    monkeypatch.setattr(base, "to_device", spy)
    config = tiny_config("dice")  # 40 steps of 8 x 16 tokens; held-out sets of 16 x 16 (major, ood)
    train(Run.create(config, path=tmp_path / "r"), device="cpu")
    token_moves = [(shape[0], device) for shape, device in moved if shape[1:] == (config.task.seq_len,)]
    assert Counter(rows for rows, _ in token_moves) == {
        config.train.batch_size: config.train.steps,
        config.train.eval_batch: 2,
    }
    assert {device for _, device in token_moves} == {torch.device("cpu")}
