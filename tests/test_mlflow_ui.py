"""The MLflow UI on a finished sweep, in a real browser: DDP against FSDP on one chart, chips on the x-axis.

A scaling sweep runs through ``rayvit.sweep.run_sweep`` with the trainer's ``fit`` replaced by known
figures (no Ray, no training: the records, curve runs and saved view are the sweep's own), ``mlflow
server`` serves the store on loopback, and headless Chromium (Debian's ``chromium`` package, driven by
Playwright) opens the experiment's page as a browser new to MLflow does, then clicks as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip("needs Debian's chromium (apt-get install chromium; .ci/run installs it)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install -e '.[test]')")

REPO = Path(__file__).resolve().parents[1]
# A closed network: everything Chromium would fetch in the background fails, so none of it starts.
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
# Per-chip TFLOPS by strategy at 1, 2 and 4 chips (falling with chips, FSDP above DDP).
TFLOPS = {"ddp": (0.50, 0.46, 0.41), "fsdp": (0.62, 0.60, 0.57), "fairscale_oss": (0.55, 0.52, 0.48)}
CHIPS = (1, 2, 4)


def fake_fit(cfg):
    """What ``rayvit.trainer.fit`` returns for one point, with the figures above."""
    from rayvit.results import RunResult

    strategy, n = cfg.parallel.strategy, cfg.parallel.num_workers
    tflops = TFLOPS[strategy][CHIPS.index(n)]
    metrics = {"images_per_sec": 200 * tflops * n, "images_per_sec_per_chip": 200 * tflops,
               "tflops_per_chip": tflops, "mfu": tflops / 2, "step_time_p50_s": 0.1, "timed_steps": 4,
               "wall_time_s": 2.0, "final_loss": 2.0}
    conditions = {"model": cfg.model.name, "image_size": cfg.model.image_size,
                  "batch_per_chip": cfg.train.batch_size, "precision": cfg.precision.mode,
                  "strategy": strategy, "world_size": n, "accelerator": "cpu", "torch_version": "2.13.0"}
    history = [{"step": s, "loss": 2.5 - 0.1 * s, "lr": 1e-3, "step_time_s": 0.1} for s in range(1, 7)]
    return RunResult(metrics, conditions, history)


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    """A finished scaling sweep (3 strategies x 1, 2, 4 chips) in a fresh sqlite store."""
    from rayvit import sweep, trainer
    from rayvit.config import load_config

    root = tmp_path_factory.mktemp("ui-store")
    uri = f"sqlite:///{root}/mlflow.db"
    cfg = load_config(REPO / "experiments" / "configs" / "cpu_default.yaml",
                      [f"tracking.uri={uri}", "sweep.name=ui-check", "sweep.worker_counts=1,2,4",
                       "sweep.strategies=ddp,fsdp,fairscale_oss"])
    saved = trainer.fit, trainer.ensure_ray, trainer.check_cluster_fits
    trainer.fit, trainer.ensure_ray, trainer.check_cluster_fits = fake_fit, lambda *a: None, lambda *a: None
    try:
        lines: list[str] = []
        report = sweep.run_sweep(cfg, experiment="ui-check", out=lines.append)
        sweep.print_summary(report, out=lines.append)
    finally:
        trainer.fit, trainer.ensure_ray, trainer.check_cluster_fits = saved
    assert report.exit_code == 0, "\n".join(lines)
    return root, uri, report, "\n".join(lines)


@pytest.fixture(scope="module")
def served(finished_sweep):
    """``mlflow server`` on a free loopback port over the sweep's store, as ``mlflow ui`` would serve it."""
    root, uri, _, _ = finished_sweep
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "server.log", "wb")
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", uri, "--artifacts-destination", str(root / "mlartifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None, (root / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "mlflow server did not start in 90 s"
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


# Every line trace Plotly draws on the page, by chart, with the chart's x-axis title (the UI keeps its own
# fields, such as metricKey, on the traces it hands Plotly).
TRACES_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).flatMap((gd, chart) =>
  (gd.data || []).filter(t => t.metricKey).map(t => ({
    chart, metric: t.metricKey, name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || []),
    colour: (t.marker && t.marker.color) || '', hover: t.hoverinfo || '',
    xTitle: (gd.layout && gd.layout.xaxis && gd.layout.xaxis.title && gd.layout.xaxis.title.text) || '',
    visible: gd.getBoundingClientRect().height > 0})))"""


def test_experiment_page_links_one_chart_of_every_strategy_against_chips(finished_sweep, served, tmp_path):
    _, _, report, printed = finished_sweep
    from mlflow import MlflowClient

    exp = MlflowClient(report.tracking_uri).get_experiment_by_name("ui-check")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    # The job's summary says where the chart is, as well as how to start the UI.
    assert f"#/experiments/{exp.experiment_id}/runs?" in printed
    assert "viewStateShareKey=rayvit-ui-check" in printed

    start = time.monotonic()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1600, "height": 1000})
        try:
            page = browser.pages[0] if browser.pages else browser.new_page()
            # The experiment's page, as a browser that never opened MLflow before sees it. Its pages
            # poll the server: wait for "load", then for what is wanted, never for "networkidle".
            page.goto(f"{served}/#/experiments/{exp.experiment_id}", wait_until="load")
            link = page.locator("a[href*='viewStateShareKey=rayvit-ui-check']").first
            link.wait_for(state="visible", timeout=60_000)
            assert "Per-chip TFLOPS of each strategy against chips" in link.inner_text()
            clicks, opened = 0, None
            # MLflow 3.17 shows a browser new to it the GenAI view, and a tip over it ("Got it"). The
            # description's links open a new tab.
            for _ in range(3):
                try:
                    with browser.expect_page(timeout=10_000) as new_tab:
                        link.click(timeout=5_000)
                    clicks += 1
                    opened = new_tab.value
                    break
                except sync_api.TimeoutError:
                    tip = page.get_by_role("button", name="Got it")
                    if tip.count() and tip.first.is_visible():
                        tip.first.click()
                        clicks += 1
            assert opened is not None and clicks <= 2, f"no chart page after {clicks} clicks"
            page = opened

            page.wait_for_function(f"() => ({TRACES_JS})().filter(t => t.metric === 'tflops_per_chip' "
                                   f"&& t.visible && t.x.length === {len(CHIPS)}).length >= {len(TFLOPS)}",
                                   timeout=60_000, polling=500)
            page.wait_for_timeout(1000)  # let the last frame paint for the screenshot
            shot = tmp_path / "ddp-vs-fsdp.png"
            page.screenshot(path=str(shot))
            print(f"\nscreenshot: {shot}  ({clicks} click(s) from the experiment's page, "
                  f"{time.monotonic() - start:.0f} s in the browser)")
            traces = page.evaluate(TRACES_JS)
            url = page.url
        finally:
            browser.close()

    assert "compareRunsMode=CHART" in url and "workflowType=machine_learning" in url
    # One chart of per-chip TFLOPS holds a curve per strategy, and nothing else: not the sweep's run,
    # not its points. (Plotly may hold a faded copy of a line under it: same name, no hover.)
    tflops = [t for t in traces if t["metric"] == "tflops_per_chip" and t["visible"]]
    charts = {t["chart"] for t in tflops}
    assert len(charts) == 1, json.dumps(tflops, indent=1)
    curves = {t["name"]: t for t in tflops if t["hover"] != "skip"}
    assert sorted(curves) == sorted(f"{s} · ui-check" for s in TFLOPS), json.dumps(tflops, indent=1)
    for strategy, figures in TFLOPS.items():
        t = curves[f"{strategy} · ui-check"]
        assert t["x"] == list(CHIPS) and t["xTitle"] == "chips", t
        assert t["y"] == pytest.approx(list(figures)), t
    # Each strategy in a colour of its own (the PNG's).
    assert len({t["colour"] for t in curves.values()}) == len(TFLOPS), curves
    # The study's other curves come with it, against chips too.
    assert {"speedup_vs_ddp", "images_per_sec_per_chip", "mfu"} <= {t["metric"] for t in traces}
    assert {t["xTitle"] for t in traces if t["visible"]} == {"chips"}
