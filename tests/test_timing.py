"""The timings of a reproduction: stages, worker stages and experiment totals (timings.json)."""

from __future__ import annotations

import json
import time

import pytest

from taskgeom.claims.registry import Experiment
from taskgeom.experiments import Context, reproduce
from taskgeom.training.timing import Timings


def busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_stages_record_wall_and_cpu_and_experiments_add_their_workers():
    timings = Timings()
    with timings.experiment("e"):
        with timings.stage("e", "sleep"):
            time.sleep(0.2)
        with timings.stage("e", "busy"):
            busy(0.2)
        timings.add("e", "remote", wall_s=5.0, cpu_s=4.0)
    sleep, work, remote = timings.stages
    assert sleep.wall_s >= 0.2 and sleep.cpu_s < 0.1
    assert work.cpu_s >= 0.2 and work.where == "main"
    assert (remote.wall_s, remote.cpu_s, remote.where) == (5.0, 4.0, "worker")
    total = timings.experiments["e"]
    assert 0.4 <= total["wall_s"] < 2  # the worker's wall time overlapped with ours: not added
    assert total["cpu_s"] == pytest.approx(4.0 + 0.2, abs=0.15)  # this process's CPU plus the worker's
    as_json = json.loads(json.dumps(timings.as_dict()))
    assert {key: as_json["total"][key] for key in ("wall_s", "cpu_s")} == total
    assert [s["peak_mb"] for s in as_json["stages"]][2] is None  # the worker reported none
    assert as_json["total"]["peak_mb"] >= max(s["peak_mb"] or 0 for s in as_json["stages"]) > 10  # this process, so far
    assert [s["stage"] for s in as_json["stages"]] == ["sleep", "busy", "remote"]


def test_a_stage_is_recorded_even_when_its_work_fails():
    timings = Timings()
    with pytest.raises(RuntimeError), timings.stage("e", "broken"):
        raise RuntimeError("boom")
    assert [s.stage for s in timings.stages] == ["broken"]


def test_reproduce_writes_the_profile_of_each_experiment(tmp_path):
    def first(ctx: Context) -> None:
        with ctx.stage("work"):
            busy(0.1)

    def second(ctx: Context) -> None:
        ctx.timings.add(ctx.experiment, "a worker's run", 1.0, 0.5)

    reproduce(tmp_path, "quick", {"first": Experiment("first", (), first), "second": Experiment("second", (), second)})
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert list(timings["experiments"]) == ["first", "second"]
    assert [(s["experiment"], s["stage"]) for s in timings["stages"]] == [
        ("first", "work"),
        ("second", "a worker's run"),
    ]
    assert timings["experiments"]["second"]["cpu_s"] >= 0.5
    assert "Timings" in (tmp_path / "report.html").read_text()


def test_work_timed_in_this_process_is_not_counted_twice():
    timings = Timings()
    with timings.experiment("e"):
        busy(0.2)
        timings.add("e", "in this process", 0.2, 0.2, where="main")
    assert timings.experiments["e"]["cpu_s"] == pytest.approx(0.2, abs=0.1)
