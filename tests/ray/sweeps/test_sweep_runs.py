"""Sweep planning, the CLI's early errors, and real sweeps through the CLI into a real MLflow store.

The end-to-end tests run ``experiments/scaling.py`` as a subprocess with few steps, then read the sqlite
store the runs went to. The default sweep runs as a user would, with no address: its own local Ray
instance. The resume, interrupt and ladder tests run several CLI commands each; they attach to one
``ray start`` head of this module (``shared_head``: 2 CPUs, token authentication with a token of its own,
as a local instance has) through ``RAY_ADDRESS``, instead of each command starting and stopping a local
instance of its own. The head keeps its own ``--temp-dir`` (so its ``ray_current_cluster`` file is
there, not in /tmp/ray, and no command without ``RAY_ADDRESS`` attaches to it) and is stopped by
killing its own process group (``clusters.Cluster``).

The default sweep runs in the background while the attached tests run (its tests come last, and wait
for it): each side spends much of its time waiting on process start-up, which the other fills. The two
write to separate stores. As soon as the default sweep exits (successfully, long before its tests run),
``mlflow server`` starts over its store, for the browser test at the end: its seconds of start-up are
spent meanwhile too.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

import browser

from helpers_cli import FEW_STEPS, SCRIPT


def run_cli(env, *args, timeout=400):
    # From another directory: results must not depend on where the user stands.
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd="/", capture_output=True,
                          text=True, timeout=timeout)


def _children(client, parent_id, kind="point"):
    exp = client.get_run(parent_id).info.experiment_id
    return client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent_id}' and tags.`rayvit.kind` = '{kind}'")


def _parent(client, experiment, sweep):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`rayvit.sweep` = '{sweep}' and tags.`rayvit.kind` = 'sweep'")
    assert len(runs) == 1
    return runs[0]


@pytest.mark.slow
def test_failed_point_is_recorded_and_rerun_resumes_only_missing_points(attached):
    root, env = attached
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    sweep = ["--name", "resume", "--set", "sweep.strategies=ddp", *FEW_STEPS]

    # 1. The only point crashes (an injected fault, no retries): recorded, exit status 1.
    proc = run_cli(env, *sweep, "--set", "sweep.worker_counts=1", "--set", "train.fail_at_step=3")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED ddp/w1" in proc.stdout
    parent = _parent(client, "cpu_default", "resume")
    assert parent.info.status == "FAILED"
    (failed,) = _children(client, parent.info.run_id)
    assert failed.info.status == "FAILED" and "injected fault on rank 0 at step 3" in failed.data.tags["rayvit.error"]

    # 2. Rerun with one more strategy: the failed point runs again and the missing one runs. (One worker
    # each: the points' count is what matters here, and a 2-worker point would add the links' benchmark.)
    both = ["--set", "sweep.strategies=ddp,fsdp"]
    proc = run_cli(env, *sweep, *both, "--set", "sweep.worker_counts=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 points ran, 0 reused, 0 failed" in proc.stdout
    children = _children(client, parent.info.run_id)
    assert sorted((c.data.tags["rayvit.point"], c.info.status) for c in children) == [
        ("ddp/w1", "FAILED"), ("ddp/w1", "FINISHED"), ("fsdp/w1", "FINISHED")]
    assert _parent(client, "cpu_default", "resume").info.run_id == parent.info.run_id

    # 3. and 4. only read what 2 left (3 is refused before it records anything; 4 finds everything finished
    # and runs nothing), so they run at once.
    with ThreadPoolExecutor(1) as pool:
        # 3. A point that cannot fit this 2-CPU cluster stops the sweep before anything runs or is recorded.
        too_big = pool.submit(run_cli, env, *sweep, *both, "--set", "sweep.worker_counts=1,3")
        # 4. Everything finished: nothing runs again, the summary comes from the store.
        proc = run_cli(env, *sweep, *both, "--set", "sweep.worker_counts=1")
        refused = too_big.result()
    assert refused.returncode == 2 and "asked for 3 workers" in refused.stderr, refused.stderr[-3000:]
    assert proc.returncode == 0 and "0 points ran, 2 reused, 0 failed" in proc.stdout
    assert len(_children(client, parent.info.run_id)) == 3
    for strategy in ("ddp", "fsdp"):
        history = client.get_metric_history(parent.info.run_id, f"tflops_per_chip/{strategy}")
        assert [m.step for m in history] == [1]


@pytest.mark.slow
def test_ctrl_c_marks_the_running_point_and_the_sweep_killed(attached, tmp_path):
    root, env = attached
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    printed, errors = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(printed, "w") as stdout, open(errors, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--name", "interrupted", "--set", "sweep.strategies=ddp",
                                 "--set", "sweep.worker_counts=1", "--set", "train.steps=5000",
                                 "--set", "train.report_every=5000"],
                                env=env, cwd="/", stdout=stdout, stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            exp = client.get_experiment_by_name("cpu_default")
            running = exp and client.search_runs(
                [exp.experiment_id], "tags.`rayvit.sweep` = 'interrupted' and tags.`rayvit.kind` = 'point'")
            if running:
                break
            time.sleep(0.5)
        # Inside Ray Train's fit(), which installs its own SIGINT handling: its workers are training (the
        # first step's progress line is out), rather than a fixed wait after the record that a busy
        # machine could outlast.
        while time.monotonic() < deadline and proc.poll() is None and not re.search(
                r"ddp/w1: (round \d/\d, )?step \d+/5000", printed.read_text()):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, err = printed.read_text(), errors.read_text()
    assert re.search(r"ddp/w1: (round \d/\d, )?step \d+/5000", out), out[-2000:] + err[-2000:]
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    assert "rerun with the same --name to resume" in err
    parent = _parent(client, "cpu_default", "interrupted")
    assert parent.info.status == "KILLED"
    (child,) = _children(client, parent.info.run_id)
    assert child.info.status == "KILLED" and "interrupted" in child.data.tags["rayvit.error"]


@pytest.mark.slow
def test_a_killed_driver_is_resumed_measuring_only_what_is_missing(attached):
    """SIGKILL (no handler runs) once the 1-worker group is recorded, during the 2-worker group: the rerun
    reuses the finished points, closes the ones the dead driver left running, and measures only those."""
    root, env = attached
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    sweep = [sys.executable, str(SCRIPT), "--name", "killed", "--set", "sweep.strategies=ddp,fsdp",
             "--set", "sweep.rounds=2", *FEW_STEPS]
    proc = subprocess.Popen(sweep, env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            exp = client.get_experiment_by_name("cpu_default")
            runs = exp and client.search_runs([exp.experiment_id], "tags.`rayvit.sweep` = 'killed' and "
                                                                   "tags.`rayvit.kind` = 'point'")
            if runs and len([r for r in runs if r.info.status == "FINISHED"]) == 2 and len(runs) == 4:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    parent = _parent(client, "cpu_default", "killed")
    before = {c.data.tags["rayvit.point"]: c.info.status for c in _children(client, parent.info.run_id)}
    assert before == {"ddp/w1": "FINISHED", "fsdp/w1": "FINISHED", "ddp/w2": "RUNNING", "fsdp/w2": "RUNNING"}

    again = run_cli(env, *sweep[2:])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "ddp/w2, fsdp/w2: left running by a driver that stopped; measuring again" in again.stdout
    assert "2 points ran, 2 reused, 0 failed" in again.stdout
    assert "running ddp, fsdp @ 2 workers" in again.stdout and "@ 1 worker " not in again.stdout
    after = sorted((c.data.tags["rayvit.point"], c.info.status) for c in _children(client, parent.info.run_id))
    assert after == [("ddp/w1", "FINISHED"), ("ddp/w2", "FINISHED"), ("ddp/w2", "KILLED"),
                     ("fsdp/w1", "FINISHED"), ("fsdp/w2", "FINISHED"), ("fsdp/w2", "KILLED")]


@pytest.mark.slow
def test_the_ladder_measures_its_rungs_on_one_worker_group(attached):
    root, env = attached
    env = {**env, "RAYVIT_HOME": str(root / "ladder-home")}      # its Ray Train runs alone in their folder
    proc = run_cli(env, "--config", str(SCRIPT.parent / "configs" / "ladder_cpu.yaml"), "--name", "ladder",
                   "--set", "sweep.rungs=baseline,mixed_precision,fsdp", "--set", "parallel.num_workers=1",
                   "--set", "sweep.rounds=2", *FEW_STEPS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "running baseline, mixed_precision, fsdp @ 1 worker on one worker group, 2 interleaved rounds" in out
    assert "3 points ran, 0 reused, 0 failed" in out
    assert re.search(r"^baseline\s+done\s+1\s.*1\.00x \(1\.00-1\.00\)\s+the baseline\s", out, re.M)
    assert re.search(r"^fsdp\s+done\s+1\s.*[\d.]+x \([\d.]+-[\d.]+\)\s+(faster than|slower than|within noise "
                     r"of) the baseline\s", out, re.M)
    # One Ray Train run for the three rungs.
    runs = [r.name for r in (root / "ladder-home" / "ray_results").glob("rayvit-*")]
    assert len(runs) == 1 and runs[0].startswith("rayvit-group-1w-"), runs
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    parent = _parent(client, "ladder_cpu", "ladder")
    rungs = {c.data.tags["rayvit.point"]: c for c in _children(client, parent.info.run_id)}
    assert set(rungs) == {"0-baseline/w1", "1-mixed_precision/w1", "2-fsdp/w1"}
    for c in rungs.values():
        m = c.data.metrics
        assert m["relative_throughput_lo"] <= m["relative_throughput"] <= m["relative_throughput_hi"]


@pytest.mark.slow
def test_hsdp_sweeps_beside_ddp_and_as_a_2x1_mesh_trains_as_ddp(attached):
    """Two workers as two replicas of one-rank shards: the same losses as DDP at every step, its own curve and
    projection in the sweep's record."""
    root, env = attached
    proc = run_cli(env, "--name", "hsdp", "--set", "sweep.strategies=ddp,hsdp", "--set", "sweep.worker_counts=2",
                   "--set", "parallel.shard_size=1", "--set", "sweep.rounds=1", *FEW_STEPS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "running ddp, hsdp @ 2 workers" in proc.stdout
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    parent = _parent(client, "cpu_default", "hsdp")
    points = {c.data.tags["rayvit.point"]: c for c in _children(client, parent.info.run_id)}
    assert set(points) == {"ddp/w2", "hsdp/w2"}
    losses = {k: [m.value for m in sorted(client.get_metric_history(c.info.run_id, "loss"), key=lambda m: m.step)]
              for k, c in points.items()}
    assert len(losses["hsdp/w2"]) == 6 and losses["hsdp/w2"] == pytest.approx(losses["ddp/w2"], rel=1e-5)
    hsdp = points["hsdp/w2"].data
    assert hsdp.params["parallel.shard_size"] == "1" and hsdp.metrics["speedup_vs_ddp"] > 0
    assert hsdp.metrics["projected_images_per_sec_per_chip"] > 0
    assert [m.step for m in client.get_metric_history(parent.info.run_id, "tflops_per_chip/hsdp")] == [2]
    assert {"scaling.png", "projection.png"} <= {f.path for f in client.list_artifacts(parent.info.run_id)}


# -- the default sweep (run in the background while the tests above ran) -----------------------------


@pytest.mark.slow
def test_default_sweep_prints_progress_table_and_ui_command(default_sweep, store):
    proc, _ = default_sweep
    out = proc.stdout
    # One worker group per worker count, every strategy in each of 3 interleaved rounds.
    assert "[1/6] running ddp, fsdp, fairscale_oss @ 1 worker on one worker group, 3 interleaved rounds" in out
    assert re.search(r"^\[4/6\] running ddp, fsdp, fairscale_oss @ 2 workers on one worker group, 3 interleaved "
                     r"rounds .*elapsed \d:\d\d, about \d+:\d\d left", out, re.M)
    assert len(re.findall(r"^\[\d/6\] round [123]/3: ddp/w\d [\d.]+, fsdp/w\d [\d.]+, fairscale_oss/w\d [\d.]+ "
                          r"img/s/chip$", out, re.M)) == 6
    assert re.search(r"^\[5/6\] fsdp/w2 done in \d+ s: [\d.e-]+ \([\d.e-]+-[\d.e-]+\) TFLOPS/chip, .* "
                     r"\(median of 3 rounds, 95% interval\)$", out, re.M)
    assert re.search(r"^fsdp/w2\s+done\s+2\s", out, re.M)
    # The table gives each figure's interval and says whether a strategy differs from DDP beyond noise.
    assert re.search(r"^ddp/w2\s+done\s+2\s+[\d.]+ \([\d.]+-[\d.]+\) .*1\.00x \(1\.00-1\.00\)\s+DDP\s", out, re.M)
    assert re.search(r"^fsdp/w2 .* [\d.]+x \([\d.]+-[\d.]+\)\s+(faster than|slower than|within noise of) DDP\s",
                     out, re.M)
    # The table's peak memory per rank (max over ranks, MiB; the process's resident set on CPU).
    lines = out.splitlines()
    titles = re.split(r"\s{2,}", next(line for line in lines if line.startswith("point ")).strip())
    fsdp2 = re.split(r"\s{2,}", next(line for line in lines if line.startswith("fsdp/w2 ")).strip())
    assert "peak MB/rank" in titles and float(fsdp2[titles.index("peak MB/rank")]) > 50
    assert "peak MB/rank on CPU: the worker process's peak resident set" in out
    assert "6 points ran, 0 reused, 0 failed" in out
    assert f"mlflow ui --backend-store-uri sqlite:///{store[0]}/mlflow.db" in out
    # The collective microbenchmark runs on the 2-worker group's own workers after their rounds (so an
    # autoscaling cluster never grows ahead of the points), and is printed once they are done.
    bench = out.index("collectives over 2 gloo ranks")
    assert out.index("[6/6] fairscale_oss/w2 done in") < bench < out.index("\npoint ")
    assert "measured on the workers of ddp/w2, fsdp/w2, fairscale_oss/w2 after their training" in out


def _check_point_run(client, child) -> None:
    """One point's MLflow run: its tags and parameters, its medians over 3 rounds with their intervals, its
    summary figures at step = chips beside its per-step history, its peak memory by rank, its projection."""
    tags, n = child.data.tags, int(child.data.tags["world_size"])
    assert child.info.status == "FINISHED"
    assert tags["strategy"] == child.data.params["parallel.strategy"]
    assert {"accelerator", "torch_version", "ray_version", "mlflow_version"} <= set(tags)
    assert child.data.params["train.steps"] == "6" and child.data.params["model.hidden_dim"] == "64"
    assert child.data.metrics["tflops_per_chip"] > 0
    # Medians over 3 rounds, each figure with its 95% interval.
    m = child.data.metrics
    assert m["rounds"] == 3 and m["timed_steps"] == 3 * 4
    for key in ("images_per_sec_per_chip", "tflops_per_chip", "mfu", "step_time_mean_s", "speedup_vs_ddp"):
        assert m[f"{key}_lo"] <= m[key] <= m[f"{key}_hi"], key
    assert tags["rayvit.verdict"] in ("DDP", "faster than DDP", "slower than DDP", "within noise of DDP")
    # Summary figures at step = chips (overlaid across children in MLflow's compare view) ...
    assert [m.step for m in client.get_metric_history(child.info.run_id, "tflops_per_chip")] == [n]
    # ... and the per-step history of the run itself.
    assert len(client.get_metric_history(child.info.run_id, "loss")) == 6
    # Peak memory: the max over ranks, each rank's at step = rank; no GPU figures on CPU.
    by_rank = client.get_metric_history(child.info.run_id, "peak_memory_bytes_by_rank")
    assert sorted(m.step for m in by_rank) == list(range(n))
    assert child.data.metrics["peak_memory_bytes_per_rank"] == max(m.value for m in by_rank)
    assert not [k for k in child.data.metrics if k.startswith("gpu_")]
    # Its projection beside it, from the sweep's own DDP 1-worker rate and the measured gloo links.
    assert child.data.metrics["projected_images_per_sec_per_chip"] > 0
    assert child.data.metrics["projected_model_state_bytes_per_rank"] == child.data.metrics[
        "model_state_bytes_per_rank"]


def _check_sweep_curves(client, parent) -> None:
    """The curves on the sweep's run (one history per strategy, step = number of chips) and its curve runs."""
    pid = parent.info.run_id
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        history = client.get_metric_history(pid, f"tflops_per_chip/{strategy}")
        assert sorted(m.step for m in history) == [1, 2]
    speedups = {m.step: m.value for m in client.get_metric_history(pid, "speedup_vs_ddp/ddp")}
    assert speedups == {1: 1.0, 2: 1.0}
    assert len(client.get_metric_history(pid, "speedup_vs_ddp/fsdp")) == 2
    assert len(client.get_metric_history(pid, "tflops_per_chip_lo/fsdp")) == 2
    assert len(client.get_metric_history(pid, "speedup_vs_ddp_hi/fairscale_oss")) == 2
    # Curve runs: top-level runs tied to the sweep by tags (so the UI charts them side by side).
    curve_runs = client.search_runs([parent.info.experiment_id], f"tags.`rayvit.sweep_run` = '{pid}'")
    assert {c.data.tags["series"] for c in curve_runs} == {"ddp", "fsdp", "fairscale_oss"}


def _check_point_rounds(client, children, tmp_path) -> None:
    """Each point's result.json keeps its rounds: step times and places in the rotated order."""
    for c in children:
        folder = tmp_path / c.info.run_id
        folder.mkdir()
        result = json.loads(Path(client.download_artifacts(c.info.run_id, "result.json", str(folder))).read_text())
        assert sorted(r["slot"] for r in result["rounds"]) == [0, 1, 2] and not result["links"]
        assert [len(r["step_times"]) for r in result["rounds"]] == [4, 4, 4]
        # The wait for each batch, timed apart from the step, on every round and the run (synthetic data
        # waits for next to nothing), in MLflow with its interval.
        assert [len(r["data_wait_times"]) for r in result["rounds"]] == [4, 4, 4]
        metrics = c.data.metrics
        assert 0 <= metrics["data_wait_fraction_lo"] <= metrics["data_wait_fraction"] <= metrics["data_wait_fraction_hi"] < 0.05


def _check_results_table(rows: list[dict]) -> None:
    """The sweep's results.parquet: six finished points, each speedup the median of its rounds' ratios."""
    assert len(rows) == 6
    assert {r["status"] for r in rows} == {"done"}
    assert all(r["model"] and r["precision"] == "fp32" and r["batch_per_chip"] == 16 for r in rows)
    ddp = {r["world_size"]: r for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        # speedup_vs_ddp: the median over rounds of the ratio within each round (same workers, adjacent in
        # time), from the step times the parquet keeps; the model's FLOPs are the same on both sides.
        mine, ref = json.loads(r["round_step_times"]), json.loads(ddp[r["world_size"]]["round_step_times"])
        per_round = sorted(sum(b) / sum(a) for a, b in zip(mine, ref))
        assert r["speedup_vs_ddp"] == pytest.approx(per_round[1])
        assert r["speedup_vs_ddp_lo"] <= r["speedup_vs_ddp"] <= r["speedup_vs_ddp_hi"] and r["rounds"] == 3
        assert len(r["peak_memory_bytes_by_rank"]) == r["world_size"]
        assert r["peak_memory_bytes_per_rank"] == max(r["peak_memory_bytes_by_rank"]) > 50 * 2**20
        assert r["gpu_utilization_pct"] is None and r["memory_measure"] == "process_rss"
        assert 0 <= r["data_wait_fraction"] < 0.05 and r["data_wait_fraction_hi"] is not None


@pytest.mark.slow
def test_default_sweep_store(default_sweep, tmp_path):
    _, client = default_sweep
    parent = _parent(client, "cpu_default", "default")  # experiment named after the config file
    assert parent.info.status == "FINISHED"
    assert parent.data.params["sweep.worker_counts"] == "[1, 2]"
    children = _children(client, parent.info.run_id)
    assert sorted(c.data.tags["rayvit.point"] for c in children) == sorted(
        f"{s}/w{n}" for s in ("ddp", "fsdp", "fairscale_oss") for n in (1, 2))
    for child in children:
        _check_point_run(client, child)
    _check_sweep_curves(client, parent)
    pid = parent.info.run_id

    names = {f.path for f in client.list_artifacts(pid)}
    assert {"config.yaml", "results.parquet", "scaling.png", "links.json", "projection.png"} <= names
    links = json.loads(Path(client.download_artifacts(pid, "links.json", str(tmp_path))).read_text())
    assert links["backend"] == "gloo" and links["world_size"] == 2
    # ... measured on the 2-worker group's workers after their rounds, with no worker group of their own.
    assert parent.data.tags["rayvit.links_measured_on"] == "ddp/w2, fsdp/w2, fairscale_oss/w2"
    _check_point_rounds(client, children, tmp_path)
    table = pq.read_table(client.download_artifacts(pid, "results.parquet", str(tmp_path)))
    assert table.num_rows == 6
    _check_results_table(table.to_pylist())
    png = Path(client.download_artifacts(pid, "scaling.png", str(tmp_path)))
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_mlflow_ui_shows_every_strategy_against_chips_within_two_clicks(default_sweep, _default_sweep_started,
                                                                              tmp_path):
    """The default sweep's store, served by ``mlflow server``, opened in headless Chromium: from the
    experiment's page, one chart of per-chip TFLOPS with a curve per strategy and chips on the x-axis."""
    reason = browser.missing()
    if reason:
        pytest.skip(reason)
    proc, client = default_sweep
    exp = client.get_experiment_by_name("cpu_default")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    # The job's summary says where the chart is, as well as how to start the UI.
    assert f"#/experiments/{exp.experiment_id}/runs?" in proc.stdout
    assert "viewStateShareKey=rayvit-default" in proc.stdout
    pid = _parent(client, "cpu_default", "default").info.run_id
    expected = {r.data.tags["series"]: {m.step: m.value for m in client.get_metric_history(r.info.run_id,
                                                                                        "tflops_per_chip")}
                for r in client.search_runs([exp.experiment_id], f"tags.`rayvit.sweep_run` = '{pid}'")}
    assert sorted(expected) == ["ddp", "fairscale_oss", "fsdp"]

    shot = tmp_path / "ddp-vs-fsdp.png"
    # ``mlflow server`` over the store, started when the sweep exited (``_DefaultSweep``).
    url = _default_sweep_started.ui.wait()
    clicks, final_url, traces = browser.open_sweep_chart(url, exp.experiment_id, "default", tmp_path / "profile",
                                                         shot, series=3, points=2)
    print(f"\nscreenshot: {shot} ({clicks} click(s) from the experiment's page)")
    assert "compareRunsMode=CHART" in final_url and "workflowType=machine_learning" in final_url
    # One chart of per-chip TFLOPS holds a curve per strategy, and nothing else: not the sweep's run,
    # not its points. (Plotly may hold a faded copy of a line under it: same name, no hover.)
    tflops = [t for t in traces if t["metric"] == "tflops_per_chip" and t["visible"]]
    assert len({t["chart"] for t in tflops}) == 1, json.dumps(tflops, indent=1)
    curves = {t["name"]: t for t in tflops if t["hover"] != "skip"}
    assert sorted(curves) == sorted(f"{s} · default" for s in expected), json.dumps(tflops, indent=1)
    for strategy, figures in expected.items():
        t = curves[f"{strategy} · default"]
        assert t["x"] == [1, 2] and t["xTitle"] == "chips", t
        assert t["y"] == pytest.approx([figures[1], figures[2]]), t
    # Each curve between its interval's ends: every strategy's lo and hi lines in the same chart.
    chart = tflops[0]["chart"]
    for end in ("_lo", "_hi"):
        lines = [t for t in traces if t["chart"] == chart and t["metric"] == f"tflops_per_chip{end}"]
        assert len(lines) >= len(expected) and all(t["x"] == [1, 2] for t in lines), json.dumps(lines, indent=1)
    # Each strategy in a colour of its own (the PNG's).
    assert len({t["colour"] for t in curves.values()}) == len(expected), curves
    # The study's other curves come with it, against chips too.
    assert {"speedup_vs_ddp", "images_per_sec_per_chip", "mfu"} <= {t["metric"] for t in traces}
    assert {t["xTitle"] for t in traces if t["visible"]} == {"chips"}


@pytest.mark.slow
def test_the_plan_ranks_the_default_sweeps_strategies_as_the_sweep_measured_them(default_sweep, tmp_path):
    """``rayvit plan --measured`` on the cpu profile, from what the sweep measured at one worker (each
    strategy's point) and its links, against the sweep's own 2-worker points: wherever two strategies'
    intervals do not overlap, the plan ranks them in that order."""
    from plan_checks import measured_order, plan_ranks

    _, client = default_sweep
    parent = _parent(client, "cpu_default", "default")
    points = {c.data.tags["rayvit.point"]: c for c in _children(client, parent.info.run_id)}
    files = [client.download_artifacts(parent.info.run_id, "links.json", str(tmp_path))]
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        (tmp_path / strategy).mkdir()
        files.append(client.download_artifacts(points[f"{strategy}/w1"].info.run_id, "result.json",
                                               str(tmp_path / strategy)))
    ranks = plan_ranks(["--config", str(SCRIPT.parent / "configs" / "cpu_default.yaml"), "--hardware", "cpu",
                        "--chips", "2", "--batch-per-chip", "16", "--measured", *files])
    separated = measured_order({s: points[f"{s}/w2"].data.metrics for s in ("ddp", "fsdp", "fairscale_oss")})
    print(f"\nplan ranks {ranks}; measured apart (faster, slower): {separated}")
    if not separated:      # a sweep on a loaded 2-core host may separate nothing: then there is no order to check
        pytest.skip("no two strategies' 95% intervals separated at 2 workers in this sweep: nothing to rank against")
    for faster, slower in separated:
        assert ranks[faster] < ranks[slower], (faster, slower, ranks)
