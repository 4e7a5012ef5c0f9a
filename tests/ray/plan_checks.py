"""Helpers for the sweep tests that hold ``rayvit plan`` against a measured sweep (not a test module)."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from typing import Mapping


def plan_ranks(args: list[str]) -> dict[str, int]:
    """``rayvit plan --json`` with ``args``: each strategy's rank (as the sweep labels it: its row with the
    config's own settings), from the rows that change nothing but the strategy."""
    from rayvit.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["plan", "--json", *args]) == 0
    rows = [json.loads(line) for line in printed.getvalue().splitlines()]
    kept = [r for r in rows if r["rank"] and not r["changes"] and r["activation_checkpointing"] == "none"]
    return {r["strategy"]: r["rank"] for r in kept}


def measured_order(metrics: Mapping[str, Mapping[str, float]]) -> list[tuple[str, str]]:
    """(faster, slower) for every two strategies whose measured images/s per chip intervals do not overlap."""
    out = []
    for a, b in itertools.permutations(metrics, 2):
        if metrics[a]["images_per_sec_per_chip_lo"] > metrics[b]["images_per_sec_per_chip_hi"]:
            out.append((a, b))
    return out
