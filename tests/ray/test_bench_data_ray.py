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


def test_two_cpus_through_ray_data_decode_faster_than_one(tmp_path):
    """Issue 39: Ray Data's read and decode spread over the CPUs it is given. 3,000 photographs (276-795 px,
    the 200 samples 15 times) in 10 files, decoded at 224 px with 1 and with 2 CPUs in alternating rounds:
    the 2-CPU rounds are faster by a margin that holds on a shared 2-core machine (measured there 1.19-1.49x,
    docs/data.md); before, the files were two read tasks and 2 CPUs gave 1.12x."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    photos = export_photos_parquet(tmp_path, per_class=25, rows_per_shard=1000)
    table = pa.concat_tables([pq.read_table(f) for f in sorted(photos.rglob("*.parquet"))])
    table = pa.concat_tables([table] * 15)
    train = tmp_path / "train"
    train.mkdir()
    for i in range(10):
        pq.write_table(table.slice(300 * i, 300), train / f"part-{i}.parquet")
    out = tmp_path / "rate.json"
    done = subprocess.run([sys.executable, "-m", "rayvit", "bench-data", f"data.path={train}", f"data.val_path={photos}",
                           "model.image_size=224", "model.num_classes=8", "train.batch_size=16", "--images", "8",
                           "--rounds", "2", "--ray-cpus", "1", "2", "--ray-images", "3000", "--json", str(out)],
                          env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    one, two = json.loads(out.read_text())["ray_data"]
    assert (one["cpus"], two["cpus"]) == (1, 2)
    assert two["vs_1_cpus"] > 1.15, f"2 CPUs through Ray Data: {two['vs_1_cpus']:.2f}x one CPU's rate"
