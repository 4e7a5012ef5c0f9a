"""``rayvit bench-data --ray-cpus``: Ray Data's own read and decode timed with N CPUs, and the projection
taking that rate. Starts its own local Ray (in the CLI's process), so it stays out of one_instance/."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers_cli import CONFIGS, cli_env
from helpers_data import export_photos_parquet


def test_bench_data_times_ray_datas_read_and_decode_and_the_projection_takes_it(tmp_path):
    photos = export_photos_parquet(tmp_path, per_class=8, rows_per_shard=16)
    out = tmp_path / "rate.json"
    env = cli_env(tmp_path)
    done = subprocess.run([sys.executable, "-m", "rayvit", "bench-data", f"data.path={photos}", "model.image_size=64",
                           "model.num_classes=8", "train.batch_size=8", "--images", "16", "--rounds", "2",
                           "--ray-cpus", "1", "2", "--ray-images", "48", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Ray Data CPUs" in done.stdout and "vs 1 CPUs" in done.stdout
    rows = json.loads(out.read_text())["ray_data"]
    assert [r["cpus"] for r in rows] == [1, 2]
    assert all(r["images_per_sec"] > 0 and len(r["rounds"]) == 2 and r["first_batch_s"] > 0 for r in rows)
    assert rows[1]["images_per_sec_per_cpu"] == rows[1]["images_per_sec"] / 2
    project = subprocess.run([sys.executable, "-m", "rayvit", "project", "--config", str(CONFIGS / "study_a100.yaml"),
                              "--set", "model.image_size=64", "--data-rate", str(out), "--chips", "8",
                              "--out-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert project.returncode == 0, project.stderr[-3000:]
    assert f"{rows[1]['images_per_sec_per_cpu']:.4g} images/s per core" in project.stdout
    assert "Ray Data's read and decode tasks with 2 CPUs" in project.stdout
