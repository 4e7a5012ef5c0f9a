"""Find the fastest precision / image size / optimizer setting whose accuracy stays within budget.

The study's fastest settings (bigger images, full half precision) can cost accuracy. This search trains
a baseline (the reference setting: fp32, the base image size, the baseline optimizer) on a real dataset,
then every setting of the ``search.space`` for the same budget, each as a multi-worker Ray Train run
launched from a Ray Tune trial. A setting is feasible when its validation accuracy is at most
``search.max_accuracy_drop`` (absolute: 0.02 = two points) below the baseline's and its loss never went
NaN/inf. The fastest feasible one, by ``search.objective`` (tflops_per_chip, images_per_sec or
time_to_accuracy), is written as a config file that experiments/scaling.py runs.

With no arguments: the digits dataset on CPU, a tiny ViT, 8 trials (bf16 amp/pure x 32/40 px x
loop/foreach AdamW) in well under 10 minutes on 2 cores.

Results go to MLflow: a parent run per search (the trials table, an accuracy-against-throughput plot with
the constraint line and the best setting marked, the best config) and a child run per trial (params,
figures, a `feasible` tag and the reason). Exit status: 0 when the search finished, 1 if a trial failed
with an error (diverged or infeasible trials are results, not errors), 2 if nothing could start (bad
config or search space, unreachable tracking store, cluster too small, baseline without an accuracy),
130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a checkout (or a `ray job submit --working-dir` copy) without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "search_cpu.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="search.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""examples:
  python experiments/search.py                                   # CPU default search
  python experiments/search.py --set search.max_accuracy_drop=0.01 --output best.yaml
  python experiments/search.py --set 'search.space={precision.mode: [amp, pure]}' --name quick
  python experiments/search.py --set search.algorithm=optuna --set search.num_samples=12
  python experiments/search.py --set search.asha=true            # stop trials that fall behind early
  python experiments/scaling.py --config best.yaml               # then scale the winner

searchable keys: precision.mode, precision.dtype, model.image_size, optim.name, optim.impl,
model.classifier, model.layout, parallel.strategy (the budget: train.steps, batch and data stay fixed).
tracking store: tracking.uri if set, else $MLFLOW_TRACKING_URI, else sqlite:///~/.rayvit/mlflow.db
($RAYVIT_HOME moves it).""")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="YAML config with a search section (default: experiments/configs/search_cpu.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set search.objective=images_per_sec "
                             "--set train.steps=100 (repeatable)")
    parser.add_argument("--name", help="search name (the MLflow parent run). Default: search.name, else "
                                       "search-<date-time>")
    parser.add_argument("--output", help="where to write the best feasible setting as a config file "
                                         "(default: ~/.rayvit/searches/<name>/best_config.yaml)")
    parser.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment, else "
                                             "rayvit-search)")
    parser.add_argument("--address", help="Ray cluster to attach to (default: $RAY_ADDRESS, as set by "
                                          "`ray job submit`; else a local instance)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rayvit.config import ConfigError, load_config
    from rayvit.sweep import eprint
    from rayvit.tracking import TrackingError

    from rayvit.trainer import ClusterTooSmall, ConnectError
    from rayvit.tune import BaselineFailed, plan_search, print_summary, run_search

    overrides = list(args.overrides) + ([f"search.name={args.name}"] if args.name else [])
    try:
        cfg = load_config(args.config, overrides)
        plan_search(cfg)     # bad input fails here, before Ray or MLflow start
        report = run_search(cfg, experiment=args.experiment, output=args.output, address=args.address)
    except (ConfigError, TrackingError, ConnectError, ClusterTooSmall, BaselineFailed) as e:
        eprint(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        eprint("interrupted: the search's MLflow parent run is marked KILLED")
        return 130
    print_summary(report)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
