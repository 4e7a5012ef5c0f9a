"""MLflow records and figures of sweeps, on real sqlite stores (no Ray, no training: results are given)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from rayvit.config import load_study, tracking_uri
from rayvit.record import plots, tracking
from rayvit.record.tables import write_parquet
from rayvit.studies.plan import plan
from rayvit.studies.runner import Outcome
from rayvit.studies.sweep import rows_of, sweep_table

from helpers_results import PNG_MAGIC, make_result

@pytest.fixture
def store(mlflow_store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    return mlflow_store


# -- where runs go ---------------------------------------------------------------------------------

def test_uri_precedence_and_absolute_local_stores(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAYVIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri() == f"sqlite:///{tmp_path}/home/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_uri() == "http://127.0.0.1:5999"
    # The config's explicit choice wins over the environment; relative paths become absolute.
    assert tracking_uri("sqlite:///rel/m.db") == f"sqlite:///{tmp_path}/rel/m.db"
    assert tracking_uri("runs/m.db") == f"sqlite:///{tmp_path}/runs/m.db"
    with pytest.raises(tracking.TrackingError, match="file store"):
        tracking_uri("./mlruns")
    with pytest.raises(tracking.TrackingError, match="file store"):
        tracking_uri("file:///tmp/mlruns")


def test_unreachable_server_is_reported_quickly():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(tracking.TrackingError, match=f"cannot reach .*127.0.0.1:{port}"):
        tracking.check_reachable(f"http://127.0.0.1:{port}")
    assert time.monotonic() - start < 10


def test_unwritable_store_folder_is_reported(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(tracking.TrackingError, match="cannot create"):
        tracking.check_reachable(f"sqlite:///{blocker}/sub/mlflow.db")


# -- parent and child runs -------------------------------------------------------------------------

def test_sweep_records_resume_and_failures(store, tmp_path, monkeypatch):
    tracking.check_reachable(store)
    # Artifacts must land beside the store, not in whatever directory the driver happens to be in.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    t = tracking.SweepTracker(store, "exp-a", "sweep-1")
    parent = t.start(params={"model.name": "custom", "sweep.worker_counts": [1, 2]}, tags={"mode": "scaling"},
                     config_yaml="model:\n  name: custom\n")
    assert not t.resumed
    ok = t.start_point("ddp/w1", "ddp/w1", "hash-a", {"parallel.strategy": "ddp"}, {"strategy": "ddp"})
    t.finish_point(ok, make_result("ddp", 1, 0.5, 100.0), step=1)
    bad = t.start_point("fsdp/w1", "fsdp/w1", "hash-b", {"parallel.strategy": "fsdp"}, {"strategy": "fsdp"})
    t.fail_point(bad, "Traceback ...\nRuntimeError: gloo timed out")
    t.end("FAILED")

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("exp-a")
    assert Path(exp.artifact_location.removeprefix("file://")).is_relative_to(tmp_path / "store")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # model training, not GenAI
    assert not list(elsewhere.iterdir())
    assert client.get_run(parent).info.status == "FAILED"
    child = client.get_run(ok)
    assert child.data.tags["mlflow.parentRunId"] == parent
    assert child.data.tags["strategy"] == "ddp" and child.data.tags["torch_version"] == "2.13.0"
    assert child.data.params["parallel.strategy"] == "ddp"
    assert child.data.metrics["tflops_per_chip"] == 0.5
    assert [m.step for m in client.get_metric_history(ok, "tflops_per_chip")] == [1]
    assert [m.step for m in client.get_metric_history(ok, "loss")] == [1, 2, 3, 4, 5]
    # Memory: the max over ranks as a figure, each rank's at step = rank; a CPU run has no GPU figures.
    assert child.data.metrics["peak_memory_bytes_per_rank"] == 4e7
    assert [(m.step, m.value) for m in client.get_metric_history(ok, "peak_memory_bytes_by_rank")] == [(0, 4e7)]
    assert child.data.tags["memory_measure"] == "process_rss"
    assert not [k for k in child.data.metrics if k.startswith("gpu_") or "reserved" in k]
    failed = client.get_run(bad)
    assert failed.info.status == "FAILED"
    assert "gloo timed out" in failed.data.tags["rayvit.error"]
    assert "error.txt" in [f.path for f in client.list_artifacts(bad)]

    # A second tracker with the same names adopts the parent and restores finished points only.
    again = tracking.SweepTracker(store, "exp-a", "sweep-1")
    assert again.start(params={"model.name": "custom"}, tags={}, config_yaml="x: 1\n") == parent
    assert again.resumed
    done = again.completed()
    assert set(done) == {"ddp/w1"}
    run_id, result, config_hash = done["ddp/w1"]
    assert (run_id, config_hash) == (ok, "hash-a")
    assert result.metrics == make_result("ddp", 1, 0.5, 100.0).metrics
    assert result.per_rank == {"peak_memory_bytes": [4e7]}
    assert result.history[-1]["loss"] == pytest.approx(1.5)
    # Another sweep name in the same experiment is a different sweep.
    other = tracking.SweepTracker(store, "exp-a", "sweep-2")
    assert other.start(params={}, tags={}, config_yaml="") != parent and other.completed() == {}


def test_curves_are_logged_once_per_chip_count(store):
    t = tracking.SweepTracker(store, "exp-b", "s")
    parent = t.start(params={}, tags={}, config_yaml="")
    assert t.log_metrics(parent, {"tflops_per_chip/ddp": 0.5, "speedup_vs_ddp/ddp": 1.0, "skip": None}, 1) == 2
    assert t.log_metrics(parent, {"tflops_per_chip/ddp": 0.5}, 1) == 0  # same value at same step: skipped
    assert t.log_metrics(parent, {"tflops_per_chip/ddp": 0.4}, 2) == 1
    # A fresh tracker (a resumed process) reads what is already there instead of duplicating it.
    t2 = tracking.SweepTracker(store, "exp-b", "s")
    t2.start(params={}, tags={}, config_yaml="")
    assert t2.log_metrics(parent, {"tflops_per_chip/ddp": 0.4}, 2) == 0
    history = MlflowClient(store).get_metric_history(parent, "tflops_per_chip/ddp")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.4)]

    # Curve runs: one per strategy, replaced (not duplicated) when the sweep logs them again.
    first = t.log_curve_run("fsdp", {"tflops_per_chip": {1: 0.6, 2: 0.55}}, {"model": "custom"})
    second = t.log_curve_run("fsdp", {"tflops_per_chip": {1: 0.6, 2: 0.55, 4: 0.5}}, {"model": "custom"})
    client = MlflowClient(store)
    live = client.search_runs([t.experiment_id], "tags.`rayvit.kind` = 'curve'")
    assert [r.info.run_id for r in live] == [second] and first != second
    assert [(m.step, m.value) for m in client.get_metric_history(second, "tflops_per_chip")] == [
        (1, 0.6), (2, 0.55), (4, 0.5)]
    # Top-level runs (the UI folds children away, out of its charts), tied to the sweep by tags, with
    # the x-axis of their charts: chips at step = chips.
    run = client.get_run(second)
    assert "mlflow.parentRunId" not in run.data.tags and run.data.tags["rayvit.sweep_run"] == parent
    assert run.data.tags["rayvit.sweep"] == "s" and run.info.run_name == "fsdp · s"
    assert [(m.step, m.value) for m in client.get_metric_history(second, "chips")] == [(1, 1), (2, 2), (4, 4)]


def test_sweep_view_and_description_link_the_curves(store):
    import json

    t = tracking.SweepTracker(store, "exp-v", "sweep 1")
    t.start(params={}, tags={}, config_yaml="")
    t.log_curve_run("ddp", {"tflops_per_chip": {1: 0.5, 2: 0.4}}, {})
    view_id = t.save_curve_view(["mfu", "tflops_per_chip"])
    client = MlflowClient(store)
    tags = client.get_experiment(t.experiment_id).tags
    envelope = json.loads(tags["mlflow.sharedViewState." + view_id])
    assert envelope["name"] == "sweep 1: per chip against chips" and view_id == "rayvit-sweep-1"
    state = json.loads(envelope["state"])
    # The view's filter finds exactly the sweep's curve runs ...
    found = client.search_runs([t.experiment_id], state["searchFilter"])
    assert [r.data.tags["series"] for r in found] == ["ddp"]
    # ... and charts each key against the chips metric, TFLOPS first.
    charts = [c for c in state["compareRunCharts"] if not c["deleted"]]
    assert [c["metricKey"] for c in charts] == ["tflops_per_chip", "mfu"]
    assert {(c["type"], c["xAxisKey"], c["selectedXAxisMetricKey"]) for c in charts} == {("LINE", "metric", "chips")}
    # The experiment's description links the newest sweep's view first (its first line is what shows).
    first_line = tags["mlflow.note.content"].splitlines()[0]
    assert f"#/experiments/{t.experiment_id}/runs?workflowType=machine_learning&compareRunsMode=CHART" \
           f"&viewStateShareKey={view_id}" in first_line and "sweep 1" in first_line

    # A second sweep comes first; the first stays linked below it. Saving again keeps a view's age.
    t2 = tracking.SweepTracker(store, "exp-v", "sweep-2")
    t2.start(params={}, tags={}, config_yaml="")
    other = t2.save_curve_view(["tflops_per_chip"])
    assert t.save_curve_view(["tflops_per_chip"]) == view_id
    note = client.get_experiment(t.experiment_id).tags["mlflow.note.content"]
    assert f"viewStateShareKey={other}" in note.splitlines()[0] and f"viewStateShareKey={view_id}" in note
    assert tracking.curve_view_link(store, "exp-v", "sweep-2") == (
        f"http://127.0.0.1:5000/#/experiments/{t.experiment_id}/runs?workflowType=machine_learning"
        f"&compareRunsMode=CHART&viewStateShareKey={other}")
    assert tracking.curve_view_link(store, "exp-v", "no such sweep") is None

    # A description the user wrote is theirs: left alone. Views are still saved.
    client.set_experiment_tag(t.experiment_id, "mlflow.note.content", "my notes")
    t2.save_curve_view(["mfu"])
    tags = client.get_experiment(t.experiment_id).tags
    assert tags["mlflow.note.content"] == "my notes" and "mfu" in tags["mlflow.sharedViewState." + other]


def test_the_views_json_draws_intervals_beside_their_curves():
    """The saved view's JSON (rayvit.record.views): one chart per key against chips, TFLOPS and the
    speed-up first; a key with an interval draws its lo and hi series in the same chart."""
    from rayvit.record import views

    state = views.curve_view_state("s'1", ["mfu", "speedup_vs_ddp", "tflops_per_chip"],
                                   bands=["tflops_per_chip", "speedup_vs_ddp"])
    assert state["searchFilter"] == "tags.`rayvit.sweep` = 's\\'1' and tags.`rayvit.kind` = 'curve'"
    charts = {c["metricKey"]: c for c in state["compareRunCharts"] if not c["deleted"]}
    assert list(charts) == ["tflops_per_chip", "speedup_vs_ddp", "mfu"]
    assert charts["tflops_per_chip"]["selectedMetricKeys"] == ["tflops_per_chip", "tflops_per_chip_lo",
                                                               "tflops_per_chip_hi"]
    assert charts["mfu"]["selectedMetricKeys"] == ["mfu"]
    assert all(c["selectedXAxisMetricKey"] == "chips" for c in charts.values())
    # The x-axis metric itself gets no chart (a deleted card keeps the UI from generating one).
    assert [c["metricKey"] for c in state["compareRunCharts"] if c["deleted"]] == ["chips"]


def test_a_view_mlflow_refuses_leaves_the_curve_runs_and_says_so(store, monkeypatch):
    """MLflow refuses an experiment tag over 20,000 characters: a view of 40 charts is one. The sweep
    says so and goes on; the curve runs are written."""
    from rayvit.studies import sweep
    from rayvit.studies.runner import StudyRun

    run = StudyRun(load_study(None, ["sweep.strategies=ddp,fsdp", "sweep.worker_counts=1,2"]), "wide", "exp-wide",
                   kind="scaling")
    run.start({})
    monkeypatch.setattr(sweep, "CURVE_KEYS", sweep.CURVE_KEYS + tuple(f"extra_{i}" for i in range(40)))
    printed = []
    sweep._log_curve_runs(run, rows_of(_outcomes(), "scaling"), printed.append)
    assert len(printed) == 1 and "did not take rayvit's chart view" in printed[0]
    assert "the curve runs ('<strategy> · wide') and scaling.png hold the same curves" in printed[0]
    client = MlflowClient(store)
    curves = client.search_runs([run.tracker.experiment_id], "tags.`rayvit.kind` = 'curve'")
    assert sorted(r.data.tags["series"] for r in curves) == ["ddp", "fsdp"]
    assert not [k for k in client.get_experiment(run.tracker.experiment_id).tags if k.startswith("mlflow.sharedViewState.")]


def _recorded_sweep(name: str, figures: dict, killed: tuple = (), failed: tuple = ()):
    """A sweep recorded as the driver records it (parent run, a child run per point, in experiment
    ``cpu_default``): ``figures`` maps finished points to their per-chip TFLOPS; ``killed`` points were
    interrupted, ``failed`` ones failed. Returns the StudyRun."""
    from rayvit.studies.runner import StudyRun

    keys = list(figures) + list(killed) + list(failed)
    counts = sorted({int(k.split("/w")[1]) for k in keys})
    study = load_study(None, ["sweep.strategies=ddp,fsdp", f"sweep.worker_counts={','.join(map(str, counts))}"])
    run = StudyRun(study, name, "cpu_default", kind="scaling")
    run.start({})
    points = {p.key: p for p in plan(study)}
    for key in keys:
        point = points[key]
        run_id = run.open_point(point, {})
        if key in killed:
            run.tracker.fail_point(run_id, "interrupted (KeyboardInterrupt: Ctrl-C / SIGINT)", status="KILLED")
        elif key in failed:
            run.tracker.fail_point(run_id, "RuntimeError: out of memory")
        else:
            run._done(point, run_id, make_result(point.series, point.world_size, figures[key], 100.0), 3.0)
    return run


def readme_pivot() -> str:
    """The README's MLflow pivot, as written (its Python block that reads the store back)."""
    import re

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "search_runs" in b)


def test_the_readmes_pivot_is_one_sweeps_finished_points_with_chips_as_numbers(store, capsys):
    """Two sweeps in one experiment: the README's pivot reads the newest alone, its finished points only
    (a killed and a failed point left out; a point run again after its settings changed counted once, its
    newest run), with chips as numbers (8 before 16 before 32, not as text)."""
    import mlflow

    _recorded_sweep("older", {"ddp/w8": 9.0, "fsdp/w8": 9.0, "ddp/w16": 9.0})
    _recorded_sweep("newer", {"ddp/w8": 1.0, "fsdp/w8": 5.0}, killed=("ddp/w16",))
    # Resumed with fsdp/w8's settings changed: it runs again; and the rest of the points.
    _recorded_sweep("newer", {"fsdp/w8": 1.5, "fsdp/w16": 1.2, "ddp/w16": 0.8, "ddp/w32": 0.6,
                                      "fsdp/w32": 1.0}, failed=("ddp/w64",))
    namespace: dict = {}
    try:
        exec(readme_pivot(), namespace)
    finally:
        mlflow.set_tracking_uri(None)
    pivot = namespace["pivot"]
    assert list(pivot.index) == [8, 16, 32] and list(pivot.columns) == ["ddp", "fsdp"]
    assert pivot.to_dict() == {"ddp": {8: 1.0, 16: 0.8, 32: 0.6}, "fsdp": {8: 1.5, 16: 1.2, 32: 1.0}}
    printed = capsys.readouterr().out
    assert "per-chip TFLOPS, sweep 'newer':" in printed


def test_existing_experiments_become_model_training_unless_the_user_chose(store):
    client = MlflowClient(store)
    bare = client.create_experiment("made-elsewhere")
    chosen = client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    assert tracking.get_or_create_experiment(client, store, "made-elsewhere") == bare
    assert tracking.get_or_create_experiment(client, store, "chosen") == chosen
    assert client.get_experiment(bare).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"


# -- result rows, parquet and figures ----------------------------------------------------------------

def _outcomes():
    cfg = load_study(None, ["sweep.strategies=ddp,fsdp", "sweep.worker_counts=1,2"])
    figures = {"ddp/w1": (0.50, 100.0), "fsdp/w1": (0.60, 120.0), "ddp/w2": (0.40, 80.0), "fsdp/w2": (0.55, 110.0)}
    out = []
    for p in plan(cfg):
        tflops, ips = figures[p.key]
        out.append(Outcome(p, "done", make_result(p.series, p.world_size, tflops, ips), run_id="r", seconds=3))
    return out


def test_rows_parquet_and_figures(tmp_path):
    outcomes = _outcomes()
    failed_point = outcomes[-1].point
    outcomes[-1] = Outcome(failed_point, "failed", error="RuntimeError: boom", run_id="x")
    rows = rows_of(outcomes, "scaling")
    by = {r["point"]: r for r in rows}
    assert by["fsdp/w1"]["speedup_vs_ddp"] == pytest.approx(1.2)
    assert by["ddp/w2"]["scaling_efficiency"] == pytest.approx(0.8)
    assert by["ddp/w2"]["speedup_vs_ddp"] == pytest.approx(1.0)
    assert by["fsdp/w2"]["tflops_per_chip"] is None and by["fsdp/w2"]["speedup_vs_ddp"] is None

    table = pq.read_table(write_parquet(rows, tmp_path / "results.parquet"))
    assert table.num_rows == 4
    for column in ("point", "strategy", "world_size", "status", "tflops_per_chip", "speedup_vs_ddp",
                   "scaling_efficiency", "model", "precision", "batch_per_chip", "torch_version", "error"):
        assert column in table.column_names
    assert table.column("status").to_pylist() == ["done", "done", "done", "failed"]

    # Per-rank memory as a list column (one float per rank), the max as a plain column.
    column_type = table.schema.field("peak_memory_bytes_by_rank").type
    assert pa.types.is_list(column_type) and pa.types.is_float64(column_type.value_type)
    assert table.column("peak_memory_bytes_by_rank").to_pylist() == [[4e7], [4e7], [4e7, 5e7], None]
    assert table.column("peak_memory_bytes_per_rank").to_pylist() == [4e7, 4e7, 5e7, None]
    assert table.column("gpu_utilization_pct").null_count == 4       # CPU: absent, not zero

    text = sweep_table(rows, "scaling")
    assert "fsdp/w1" in text and "1.20x" in text and "failed" in text
    header, _, *lines = text.splitlines()
    assert "peak MB/rank" in header and "GPU util" not in header and "reserved" not in header
    assert "38.1" in lines[0] and "47.7" in lines[2]                  # 4e7 and 5e7 bytes in MiB
    assert "resident set" in lines[-1]                                 # what the column means on CPU

    # On GPUs: the reserved peak, utilisation and power per GPU too.
    gpu_rows = rows_of([Outcome(o.point, "done", make_result(o.point.series, o.point.world_size, 0.5, 100.0,
                                                             gpu=True), run_id="g", seconds=3)
                        for o in outcomes[:3]], "scaling")
    text = sweep_table(gpu_rows, "scaling")
    header, _, *lines = text.splitlines()
    for column in ("peak MB/rank", "reserved MB/rank", "GPU util", "W/GPU"):
        assert column in header
    assert lines[2].split()[-5:] == ["47.7", "66.8", "85%", "375", "3"] and len(lines) == 3
    table = pq.read_table(write_parquet(gpu_rows, tmp_path / "gpu.parquet"))
    assert table.column("gpu_power_w_by_rank").to_pylist()[2] == [400.0, 350.0]
    assert table.column("gpu_utilization_pct").to_pylist() == [90.0, 90.0, 85.0]

    ok = [r for r in rows if r["status"] == "done"]
    png = plots.scaling_figure(ok, tmp_path / "scaling.png")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    caption = plots.conditions_caption(ok, omit=("strategy", "world_size"))
    assert "custom" in caption and "32 px" in caption and "batch 16/chip" in caption and "torch 2.13.0" in caption


def test_ladder_rows_and_figure(tmp_path):
    cfg = load_study(None, ["sweep.mode=ladder", "sweep.rungs=baseline,mixed_precision,fsdp",
                             "parallel.num_workers=2"])
    points = plan(cfg)
    outcomes = [Outcome(p, "done", make_result(p.cfg.parallel.strategy, 2, t, 10 * t), run_id="r")
                for p, t in zip(points, (0.5, 0.8, 0.9))]
    rows = rows_of(outcomes, "ladder")
    assert [round(r["relative_throughput"], 2) for r in rows] == [1.0, 1.6, 1.8]
    ladder = sweep_table(rows, "ladder")
    assert "1.80x" in ladder and "peak MB/rank" in ladder.splitlines()[0]
    png = plots.ladder_figure(rows, tmp_path / "ladder.png")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


