"""The DataContext of the datasets rayvit runs: its own copy, so that what rayvit sets for its execution
never reaches the caller's Dataset or ``DataContext.get_current()``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayvit.config_schema import Config

if TYPE_CHECKING:
    import ray.data


def own_context(dataset: "ray.data.Dataset", cfg: Config) -> "ray.data.Dataset":
    """``dataset`` with a DataContext of its own (a copy), quiet unless ``data.progress_bars``.

    A Dataset derived from another shares its context object, and a read shares the process's current
    one: settings made for rayvit's execution (the sizes the workers read, quiet progress) would change the
    caller's dataset and ``DataContext.get_current()``. Ray Data's progress bars print a line per operator
    every few seconds of every epoch on the driver's console; rayvit runs them only when asked."""
    from ray.data import Dataset

    out = Dataset.copy(dataset, _deep_copy=True)
    if not cfg.data.progress_bars:
        context = out.context
        context.enable_progress_bars = context.enable_operator_progress_bars = False
        context.print_on_execution_start = False
    return out
