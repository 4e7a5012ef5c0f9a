"""Writing to the MLflow runs of one experiment: params and tags in batches, metrics logged once per
``(step, value)`` (a resumed sweep logs its figures again and adds no duplicate points), histories, and
the experiment's runs found by a filter. :class:`~rayvit.record.tracking.SweepTracker` builds a sweep's
runs on it; only the driver writes to MLflow, workers never do."""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Optional

from rayvit.formats import number as _number
from rayvit.record.views import now_ms


def param_value(value: Any) -> str:
    """A parameter's value as MLflow keeps it: JSON for lists and dicts, cut to MLflow's limit."""
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text[:6000]  # MLflow's parameter value limit


class RunWriter:
    """Writes params, tags and metrics to any run of experiment ``experiment_id`` through ``client``
    (an ``MlflowClient``), and finds the experiment's runs (:meth:`search_runs`)."""

    def __init__(self, client, experiment_id: str) -> None:
        self.client = client
        self.experiment_id = experiment_id
        self._logged: dict[tuple[str, str], set[tuple[int, float]]] = {}

    def log(self, run_id: str, params: Mapping[str, Any] = {}, tags: Mapping[str, Any] = {}) -> None:
        """Params (write-once in MLflow) and tags of a run, in one batch."""
        from mlflow.entities import Param, RunTag

        self.client.log_batch(
            run_id,
            params=[Param(k, param_value(v)) for k, v in params.items()],
            tags=[RunTag(k, str(v)[:8000]) for k, v in tags.items()])

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        self.log(run_id, tags=tags)

    def log_metrics(self, run_id: str, metrics: Mapping[str, Any], step: int) -> int:
        """Log the finite numbers in ``metrics`` at ``step``, skipping values already logged there.

        A resumed sweep recomputes its curves; without the check each rerun would add duplicate points.
        """
        from mlflow.entities import Metric

        now = now_ms()
        batch = []
        for key, value in metrics.items():
            value = _number(value)
            if value is None:
                continue
            seen = self._history(run_id, key)
            if (step, value) in seen:
                continue
            seen.add((step, value))
            batch.append(Metric(key, value, now, step))
        if batch:
            self.client.log_batch(run_id, metrics=batch)
        return len(batch)

    def _history(self, run_id: str, key: str) -> set[tuple[int, float]]:
        if (run_id, key) not in self._logged:
            self._logged[(run_id, key)] = {(m.step, m.value)
                                           for m in self.client.get_metric_history(run_id, key)}
        return self._logged[(run_id, key)]

    def log_history(self, run_id: str, entries: Iterable[tuple[str, Any, int]]) -> None:
        """``(key, value, step)`` entries of a run's history, the finite ones, in one batch."""
        from mlflow.entities import Metric

        now = now_ms()
        batch = [Metric(key, v, now, step) for key, value, step in entries
                 if (v := _number(value)) is not None]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def search_runs(self, filter_string: str, order_by: Optional[list[str]] = None) -> list:
        """Every run of the experiment that ``filter_string`` matches (all pages)."""
        runs, token = [], None
        while True:
            page = self.client.search_runs([self.experiment_id], filter_string, order_by=order_by,
                                           max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                return runs
