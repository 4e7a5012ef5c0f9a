"""What the commands share: the config options, the Ray and MLflow options of the commands that run, and
the one-line errors and exit statuses every command gives."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from rayvit.config import config_path

TRACKING_HELP = ("tracking store: tracking.uri if set, else $MLFLOW_TRACKING_URI, else "
                 "sqlite:///~/.rayvit/mlflow.db ($RAYVIT_HOME moves it)")

PLAN_POINTER = ("before renting: `rayvit plan --config {config}` ranks strategies, batch sizes, activation "
                "checkpointing, precisions and image sizes by hours and cost per epoch (no cluster needed)")


def described_parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A parser whose description and examples keep their own line breaks."""
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def config_options(parser: argparse.ArgumentParser, default_config: Path, what: str = "YAML config",
                   example: str = "train.steps=10") -> None:
    parser.add_argument("--config", default=str(default_config), type=config_path,
                        help=f"{what}: a file, or the name of one rayvit ships (default: "
                             f"{default_config.name}, as in experiments/configs)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a config value, e.g. --set {example} (repeatable)")


def run_options(parser: argparse.ArgumentParser, default_config: Path, what: str) -> None:
    """The options of a command that runs on Ray and records in MLflow (a sweep, a search)."""
    config_options(parser, default_config)
    parser.add_argument("--name", help=f"{what} name (the MLflow parent run); an existing name resumes it")
    parser.add_argument("--address", help="Ray cluster to attach to, host:port of its GCS (default: "
                                          "$RAY_ADDRESS, as set by `ray job submit`; else a local "
                                          "instance). Token clusters: give the token as $RAY_AUTH_TOKEN")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show Ray's worker and controller output as it comes (by default it goes to "
                             "~/.rayvit/logs/<name>.log; warnings and errors still show, once each)")


def eprint(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def guarded(run: Callable[[], int], interrupted: str) -> int:
    """Start-up errors (exit 2) and Ctrl-C (exit 130) said in one line each, as a CLI should."""
    from rayvit.errors import BaselineFailed, ClusterTooSmall, ConfigError, ConnectError, TrackingError
    from rayvit.launch.console import quiet_loggers

    quiet_loggers()
    try:
        return run()
    except (ConfigError, TrackingError, ConnectError, ClusterTooSmall, BaselineFailed) as e:
        eprint(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        eprint(f"interrupted: {interrupted}")
        return 130
