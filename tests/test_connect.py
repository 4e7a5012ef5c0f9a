"""Reaching a cluster, without starting Ray.

Unreachable addresses run the real CLI against ports nothing listens on: it must exit with status 2
within 30 s, naming the address and what to check (Ray's own connect path retries for minutes). The
auth modes are in test_cluster_auth.py and test_scaling_job.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from clusters import clean_env, free_port

REPO = Path(__file__).resolve().parents[1]


def _scaling(tmp_path: Path, args: list[str], **env: str) -> subprocess.Popen:
    run_env = clean_env(RAYVIT_HOME=str(tmp_path / "home"), **env)
    run_env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path}/mlflow.db"
    return subprocess.Popen([sys.executable, "experiments/scaling.py", "--set", "sweep.strategies=ddp",
                             "--set", "sweep.worker_counts=1", *args], cwd=REPO, env=run_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, start: float) -> tuple[int, str, float]:
    try:
        out, _ = proc.communicate(timeout=max(1.0, 60 - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out, time.monotonic() - start


def test_unreachable_cluster_is_a_clear_error_within_30s(tmp_path):
    """``--address`` naming a port nothing listens on: exit 2 within 30 s, naming the address."""
    address = f"127.0.0.1:{free_port()}"          # free: nothing listens there
    rc, out, took = _finish(_scaling(tmp_path, ["--address", address]), time.monotonic())
    assert rc == 2, f"rc {rc}\n{out[-3000:]}"
    assert took < 30, f"took {took:.0f} s:\n{out[-3000:]}"
    error = next(line for line in out.splitlines() if line.startswith("error:"))
    assert address in error and "no Ray cluster answered" in error, error
    assert "head node is up" in error and "GCS address" in error and "RAY_ADDRESS" in error, error
    assert "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "mlflow.db").exists(), "the address is checked before the tracking store is set up"


def test_dead_ray_address_is_a_clear_error(tmp_path):
    """``$RAY_ADDRESS`` left over from a cluster that is gone: the library call fails the same way."""
    address = f"127.0.0.1:{free_port()}"
    code = ("import time; from rayvit.launch.connect import ensure_ray, ClusterUnreachable\n"
            "t = time.monotonic()\n"
            "try:\n    ensure_ray()\nexcept ClusterUnreachable as e:\n"
            "    print(f'{time.monotonic() - t:.1f}|{e}')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(RAY_ADDRESS=address),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "|" in out.stdout, out.stdout + out.stderr[-3000:]
    took, error = out.stdout.strip().split("|", 1)
    assert float(took) < 20 and address in error and "RAY_ADDRESS" in error, out.stdout


def test_dashboard_url_as_address_says_what_to_use(tmp_path):
    rc, out, took = _finish(_scaling(tmp_path, ["--address", "http://127.0.0.1:8265"]), time.monotonic())
    assert rc == 2, out[-3000:]
    assert "dashboard" in out and "ray job submit --address http://127.0.0.1:8265" in out, out[-3000:]
    assert took < 30


def test_library_import_sets_no_auth_mode():
    """Importing rayvit's Ray layer leaves Ray's auth mode alone: it is chosen when Ray is reached."""
    env = clean_env()
    code = "import os, rayvit.trainer, rayvit.sweep, rayvit.tune; print(os.environ.get('RAY_AUTH_MODE'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "None"
