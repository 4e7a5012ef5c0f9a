"""How long the default sweep's points wait for parquet data, at 1 and 2 CPU workers, per prefetch setting.

    python benchmarks/data_wait.py [--cpus 3] [--prefetch 1 4] [--rounds 3] [--image-size 32]

Makes the sample photographs (rayvit.data.photos, 320 ImageNet-sized JPEGs), starts a local Ray with
``--cpus`` logical CPUs (Ray Data's read and decode tasks need CPUs beside the training workers': with
as many as the workers take, a Ray Dataset never reads), and runs the CPU default sweep
(experiments/configs/cpu_default.yaml: ddp, fsdp, fairscale_oss at 1 and 2 workers) on them with
``data.name=parquet``, once per ``data.prefetch_batches`` value, into a temporary MLflow store. Prints
each point's images/s per chip and ``data_wait_fraction`` with their 95% intervals, and the CPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", type=int, default=3, help="logical CPUs of the local Ray (default 3)")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()

    import ray

    from rayvit.config import load_study
    from rayvit.worker.bench_data import cpu_description
    from rayvit.datasets import make_photos, to_parquet
    from rayvit.formats import interval
    from rayvit.studies.sweep import run_sweep

    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        to_parquet(make_photos(Path(tmp) / "photos", per_class=40), Path(tmp) / "parquet", rows_per_shard=80)
        os.environ["RAYVIT_HOME"] = str(Path(tmp) / "home")
        ray.init(num_cpus=args.cpus, include_dashboard=True, runtime_env={"env_vars": {"PYTHONPATH": str(repo)}})
        lines = [f"CPU: {cpu_description()}; local Ray with {args.cpus} logical CPUs on {os.cpu_count()} cores"]
        try:
            for prefetch in args.prefetch:
                study = load_study(repo / "experiments" / "configs" / "cpu_default.yaml", [
                    "data.name=parquet", f"data.path={Path(tmp) / 'parquet'}", "model.num_classes=8",
                    f"model.image_size={args.image_size}", f"data.prefetch_batches={prefetch}",
                    f"sweep.rounds={args.rounds}", f"sweep.name=prefetch-{prefetch}",
                    f"tracking.uri=sqlite:///{tmp}/mlflow.db"])
                report = run_sweep(study, experiment="data-wait", out=lambda line: None)
                for row in report.rows:
                    lines.append(f"prefetch_batches={prefetch} {row['point']:<18} {row['status']:<6} "
                                 f"img/s/chip {interval(row.get('images_per_sec_per_chip'), row.get('images_per_sec_per_chip_lo'), row.get('images_per_sec_per_chip_hi'), '.1f')}"
                                 f"  data_wait_fraction {interval(row.get('data_wait_fraction'), row.get('data_wait_fraction_lo'), row.get('data_wait_fraction_hi'), '.1%')}")
        finally:
            ray.shutdown()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
