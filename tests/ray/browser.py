"""The MLflow UI in a real browser, for tests: ``mlflow server`` over a store, headless Chromium (Debian's
``chromium`` package, driven by Playwright), and what a user sees of a sweep's charts."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# A closed network: everything Chromium would fetch in the background fails, so none of it starts.
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def missing() -> Optional[str]:
    """Why a browser test cannot run here (None when it can)."""
    if not os.access(CHROMIUM, os.X_OK):
        return "needs Debian's chromium (apt-get install chromium; .ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "needs playwright (pip install -e '.[test]')"
    return None


class MlflowServer:
    """``mlflow server`` on a free loopback port over ``uri``'s store, as ``mlflow ui`` would serve it,
    less MLflow's job execution (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``): with it on, the server
    starts a job runner and seven huey consumers, eight more Python processes importing MLflow, for the
    GenAI features' background jobs. No page a sweep's charts are on uses them, and on 2 cores their
    start-up slowed the server's own start, Chromium's launch and the page's first load, and their stop
    the server's (measured: 21 s -> 15 s from server start to server stopped).

    ``start()`` returns at once (the server starts up meanwhile), ``wait()`` until it answers; ``stop()``
    ends its whole process group (uvicorn runs as a child of the ``mlflow server`` command)."""

    def __init__(self, uri: str, root: Path):
        self.uri, self.root = uri, Path(root)
        self.process: Optional[subprocess.Popen] = None
        self.url = ""

    def start(self) -> "MlflowServer":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        with open(self.root / "server.log", "wb") as log:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                 "--workers", "1", "--backend-store-uri", self.uri,
                 "--artifacts-destination", str(self.root / "mlartifacts")],
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait(self, timeout: float = 90) -> str:
        """Until the server answers its health check; returns its URL."""
        assert self.process is not None, "the server was never started"
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return self.url
            except OSError:
                assert self.process.poll() is None, (self.root / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"mlflow server did not start in {timeout:g} s"
                time.sleep(0.25)

    def stop(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None


# Every line trace Plotly draws on the page, by chart, with the chart's x-axis title (the UI keeps its own
# fields, such as metricKey, on the traces it hands Plotly).
TRACES_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).flatMap((gd, chart) =>
  (gd.data || []).filter(t => t.metricKey).map(t => ({
    chart, metric: t.metricKey, name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || []),
    colour: (t.marker && t.marker.color) || '', hover: t.hoverinfo || '',
    xTitle: (gd.layout && gd.layout.xaxis && gd.layout.xaxis.title && gd.layout.xaxis.title.text) || '',
    visible: gd.getBoundingClientRect().height > 0})))"""


def open_sweep_chart(url: str, experiment_id: str, sweep: str, profile: Path, screenshot: Path,
                     series: int, points: int) -> tuple[int, str, list[dict]]:
    """From the experiment's page, click to the sweep's chart as a user would; wait until its per-chip
    TFLOPS chart holds ``series`` curves of ``points`` points. Returns (clicks, final URL, traces)."""
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1600, "height": 1000})
        try:
            page = browser.pages[0] if browser.pages else browser.new_page()
            # The experiment's page, as a browser that never opened MLflow before sees it. Its pages
            # poll the server: wait for "load", then for what is wanted, never for "networkidle".
            page.goto(f"{url}/#/experiments/{experiment_id}", wait_until="load")
            link = page.locator(f"a[href*='viewStateShareKey=rayvit-{sweep}']").first
            link.wait_for(state="visible", timeout=60_000)
            assert "Per-chip TFLOPS of each strategy against chips" in link.inner_text()
            # MLflow 3.17 shows a browser new to it the GenAI view, and a tip over it ("Got it") that can
            # cover the link. Playwright dismisses it (a click, counted) whenever it is up before or during
            # an action, instead of the link's click waiting out its timeout under it. The description's
            # links open a new tab.
            clicks = 0

            def dismiss_tip(tip) -> None:
                nonlocal clicks
                tip.first.click()
                clicks += 1

            page.add_locator_handler(page.get_by_role("button", name="Got it"), dismiss_tip)
            with browser.expect_page(timeout=30_000) as new_tab:
                link.click(timeout=20_000)
            clicks += 1
            opened = new_tab.value
            assert clicks <= 2, f"the chart page took {clicks} clicks"
            page = opened
            page.wait_for_function(f"() => ({TRACES_JS})().filter(t => t.metric === 'tflops_per_chip' "
                                   f"&& t.visible && t.x.length === {points}).length >= {series}",
                                   timeout=60_000, polling=500)
            page.wait_for_timeout(1000)  # let the last frame paint for the screenshot
            page.screenshot(path=str(screenshot))
            return clicks, page.url, page.evaluate(TRACES_JS)
        finally:
            browser.close()
