"""Ray Tune search: the fastest setting whose accuracy stays within a stated drop of the baseline.

:func:`run_search` does, in order:

1. :func:`~rayvit.studies.plan.plan_search` validates the ``search`` section against the run config, so an
   empty space, an unknown key or a constraint without a baseline fails before anything starts;
2. the screen (grid searches, ``search.screen``, :mod:`.screen`) times every setting's training step on
   one trial device and decides the order trials run in and which are not trained;
3. the baseline (the reference setting) trains as a point of the study; its validation accuracy is what
   the constraint is measured from, and a trial must beat its objective beyond noise (a rerun of the
   same search reuses it, and every finished trial, from MLflow);
4. every trial is a Tune function trainable that launches a multi-worker Ray Train run and judges itself
   (:mod:`.trials`, :mod:`.judge`): grid settings best screened first, stopping once no remaining setting
   can win, or Optuna TPE; optional ASHA (:mod:`.tuner`);
5. each trial is recorded in MLflow as a child run; the best feasible setting that beats the baseline
   beyond noise (else the baseline) is written as a config file that ``rayvit sweep --config`` runs
   (:mod:`.report`).

SIGINT or SIGTERM stops the trials and raises :class:`SearchInterrupted` (no best config).
Every trial gets the same budget (``train.steps`` at ``train.batch_size``); the space may only hold keys
that change how the work is done (:data:`~rayvit.studies.plan.SEARCHABLE_KEYS`), never how much.
``rayvit search --dry-run`` (:mod:`.dryrun`) prices a search before any cluster exists.

The modules: :mod:`.run` (the steps in order), :mod:`.session` (what the driver knows while the
search runs), :mod:`.screen`, :mod:`.trials`, :mod:`.tuner`, :mod:`.judge`, :mod:`.report`,
:mod:`.dryrun`. The names below are imported from them on first use, so that the dry run, which needs
none of Ray Tune, torch or MLflow, imports none of them by importing this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayvit.studies.outcome import Verdict
    from rayvit.studies.search.dryrun import describe_search
    from rayvit.studies.search.judge import BaselineFailed, SearchInterrupted
    from rayvit.studies.search.report import SearchReport, print_summary, search_table, write_best_config
    from rayvit.studies.search.run import default_search_name, run_search

# What callers import from here: running a search, what it reports and raises, and the dry run.
__all__ = ["BaselineFailed", "SearchInterrupted", "SearchReport", "Verdict", "default_search_name",
           "describe_search", "print_summary", "run_search", "search_table", "write_best_config"]


def __getattr__(name: str) -> Any:
    if name in ("run_search", "default_search_name"):
        from rayvit.studies.search import run as module
    elif name in ("SearchReport", "print_summary", "search_table", "write_best_config"):
        from rayvit.studies.search import report as module
    elif name in ("BaselineFailed", "SearchInterrupted"):
        from rayvit.studies.search import judge as module
    elif name == "describe_search":
        from rayvit.studies.search import dryrun as module
    elif name == "Verdict":
        from rayvit.studies import outcome as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
