"""The MLflow UI in a real browser, for tests: ``mlflow server`` over a store, headless Chromium (Debian's
``chromium`` package, driven by Playwright), and what a user sees of a sweep's charts."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

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


@contextlib.contextmanager
def mlflow_server(uri: str, root: Path) -> Iterator[str]:
    """``mlflow server`` on a free loopback port over ``uri``'s store, as ``mlflow ui`` would serve it."""
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
                                   f"&& t.visible && t.x.length === {points}).length >= {series}",
                                   timeout=60_000, polling=500)
            page.wait_for_timeout(1000)  # let the last frame paint for the screenshot
            page.screenshot(path=str(screenshot))
            return clicks, page.url, page.evaluate(TRACES_JS)
        finally:
            browser.close()
