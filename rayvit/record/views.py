"""rayvit's chart view of a sweep in the MLflow UI: a saved view of the experiment's Runs page with
every strategy's curve against chips, and a link to it atop the experiment's description.

MLflow has no API for saved views: the UI keeps them in experiment tags (``mlflow.sharedViewState.<id>``)
as the JSON it writes itself when a user saves a view, and the description in ``mlflow.note.content``.
This module writes that JSON; it was checked against MLflow 3.0-3.17 (the UI of 3.17.2 in headless
Chromium, ``tests/ray/browser.py``). Should a later MLflow reject it, :func:`save_curve_view` raises and
the sweep goes on without the view: the curve runs and the PNG it also records hold the same curves.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Iterable, Mapping, Optional

# Tags and names shared with rayvit.record.tracking, which tags the runs this view lists.
TAG_SWEEP = "rayvit.sweep"
TAG_KIND = "rayvit.kind"
CHECKED_MLFLOW = ("3.0", "3.17")               # the MLflow versions whose UI read this JSON

TAG_SAVED_VIEW = "mlflow.sharedViewState."     # + view id: a saved view of the experiment's Runs page
TAG_NOTE = "mlflow.note.content"               # the experiment's description (markdown), atop its page
TAG_RAYVIT_NOTE = "rayvit.note"                # the description as rayvit last wrote it
CURVE_X = "chips"                              # the x-axis metric every curve run carries
VIEW_PREFIX = "rayvit-"                        # ids of the saved views rayvit writes (one per sweep)
VIEW_SUFFIX = ": per chip against chips"       # their names: the sweep's name + this
MAX_VIEWS = 20                                 # the newest kept (the UI stops saving views at 40)
MLFLOW_UI = "http://127.0.0.1:5000"            # where `mlflow ui` serves by default


def quote(value: str) -> str:
    """``value`` as a quoted string of an MLflow search filter."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def now_ms() -> int:
    return int(time.time() * 1000)


def _md(text: str) -> str:
    """``text`` as literal markdown (link text)."""
    return re.sub(r"([\\`*_\[\]<>#|])", r"\\\1", text)


def _saved_views(tags: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """``{view id: envelope}`` of the saved views rayvit wrote, from an experiment's tags."""
    views = {}
    for key, value in tags.items():
        if key.startswith(TAG_SAVED_VIEW + VIEW_PREFIX):
            try:
                envelope = json.loads(value)
                int(envelope["createdAt"]), str(envelope["name"])
            except (ValueError, KeyError, TypeError):
                continue
            views[key[len(TAG_SAVED_VIEW):]] = envelope
    return views


def curve_view_state(sweep: str, keys: list[str], bands: Iterable[str] = ()) -> dict[str, Any]:
    """A saved view of the MLflow (3.x) experiment page: ``sweep``'s curve runs, each key against chips.

    The JSON the UI itself writes when a user saves a view (its search facets and
    ``ExperimentPageUIState``): a filter on the sweep's curve runs, all of them shown, and one line chart
    per key whose x-axis is the ``chips`` metric. Fields left out take the UI's defaults. A key in
    ``bands`` is drawn with its ``<key>_lo`` and ``<key>_hi`` series in the same chart (the interval).
    """
    bands = set(bands)
    section, model, system = (f"rayvit-{name}" for name in ("curves", "model", "system"))
    first = [k for k in ("tflops_per_chip", "speedup_vs_ddp") if k in keys]
    charts = [{
        "uuid": f"rayvit-chart-{i}", "type": "LINE", "metricSectionId": section, "deleted": False,
        "isGenerated": False, "runsCountToCompare": 20, "metricKey": key,
        "selectedMetricKeys": [key] + ([f"{key}_lo", f"{key}_hi"] if key in bands else []),
        "xAxisKey": "metric", "selectedXAxisMetricKey": CURVE_X, "useGlobalXaxisKey": False,
        "xAxisScaleType": "linear", "scaleType": "linear", "lineSmoothness": 0,
        "useGlobalLineSmoothing": False, "displayPoints": True, "yAxisKey": "metric",
        "yAxisExpressions": [], "ignoreOutliers": False, "range": {},
    } for i, key in enumerate(first + [k for k in keys if k not in first])]
    # The x-axis metric gets no chart of its own (a chart of chips against chips); a deleted card
    # keeps the UI from generating one.
    charts.append({"uuid": "rayvit-chart-x", "type": "LINE", "metricSectionId": model, "deleted": True,
                   "isGenerated": True, "metricKey": CURVE_X})
    return {
        "searchFilter": f"tags.`{TAG_SWEEP}` = {quote(sweep)} and tags.`{TAG_KIND}` = 'curve'",
        "orderByKey": "attributes.start_time", "orderByAsc": True,
        "runsHiddenMode": "SHOW_ALL",
        "compareRunCharts": charts,
        "compareRunSections": [
            {"uuid": section, "name": "per chip, against chips", "display": True, "isReordered": True,
             "deleted": False, "isGenerated": False, "columns": 2, "cardHeight": 420},
            {"uuid": model, "name": "Model metrics", "display": True, "isReordered": False,
             "deleted": False, "isGenerated": True},
            {"uuid": system, "name": "System metrics", "display": True, "isReordered": False,
             "deleted": False, "isGenerated": True},
        ],
        "isAccordionReordered": False,
        "hideEmptyCharts": True,
        "globalLineChartConfig": {"xAxisKey": "metric", "selectedXAxisMetricKey": CURVE_X,
                                  "lineSmoothness": 0},
    }


def view_link(experiment_id: str, view_id: str, base: str = "") -> str:
    """A link to a saved view's charts: the Runs page, as model training, in chart mode.

    ``base`` empty gives the in-page link the experiment's description uses. The UI's own "Views"
    menu opens a view in table mode, and MLflow 3.17 picks GenAI or model training from its sidebar
    switch (remembered per browser), not from ``mlflow.experimentKind``: the link says both.
    """
    root = base.rstrip("/") + "/" if base else ""
    return (f"{root}#/experiments/{experiment_id}/runs?workflowType=machine_learning"
            f"&compareRunsMode=CHART&viewStateShareKey={view_id}")


def curve_view_link(client, uri: str, experiment: str, sweep: str) -> Optional[str]:
    """The browser link to sweep ``sweep``'s chart view in store ``uri``, once it has one (else None)."""
    try:
        exp = client.get_experiment_by_name(experiment)
    except Exception:  # noqa: BLE001 - only a hint for the user
        return None
    view_id = _view_id(sweep)
    if exp is None or TAG_SAVED_VIEW + view_id not in exp.tags:
        return None
    base = uri if uri.startswith(("http://", "https://")) else MLFLOW_UI
    return view_link(exp.experiment_id, view_id, base)


def _view_id(sweep: str) -> str:
    return VIEW_PREFIX + (re.sub(r"[^A-Za-z0-9_-]+", "-", sweep).strip("-") or "sweep")


def save_curve_view(client, experiment_id: str, sweep: str, keys: Iterable[str], bands: Iterable[str] = ()) -> str:
    """Save (or refresh) ``sweep``'s view of the experiment's Runs page; returns its id.

    The view lists the sweep's curve runs and charts each of ``keys`` against chips, one line per
    strategy (with ``<key>_lo``/``<key>_hi`` beside each key in ``bands``). The UI lists it under "Views"
    on the Runs page; the experiment's description links to the newest sweeps' views
    (:func:`describe_views`), so the chart is one click from the experiment's page.
    """
    view_id = _view_id(sweep)
    tags = client.get_experiment(experiment_id).tags
    views = _saved_views(tags)
    now = now_ms()
    created = views.get(view_id, {}).get("createdAt", now)
    envelope = {"name": sweep + VIEW_SUFFIX, "createdAt": created, "updatedAt": now,
                "state": json.dumps(curve_view_state(sweep, list(keys), bands), separators=(",", ":"))}
    client.set_experiment_tag(experiment_id, TAG_SAVED_VIEW + view_id, json.dumps(envelope, separators=(",", ":")))
    views[view_id] = envelope
    newest = sorted(views, key=lambda v: views[v]["createdAt"], reverse=True)
    for old in newest[MAX_VIEWS:]:
        client.delete_experiment_tag(experiment_id, TAG_SAVED_VIEW + old)
    describe_views(client, experiment_id, [(v, views[v]["name"]) for v in newest[:MAX_VIEWS]], tags)
    return view_id


def describe_views(client, experiment_id: str, views: list[tuple[str, str]], tags: Mapping[str, str]) -> None:
    """Link the newest sweep's chart view in the experiment's description (its first line shows).

    Only a description rayvit wrote (or none) is rewritten: one a user edited is left alone.
    """
    note = tags.get(TAG_NOTE, "")
    if note.strip() and note != tags.get(TAG_RAYVIT_NOTE):
        return
    sweeps = [(view_id, _md(name.removesuffix(VIEW_SUFFIX))) for view_id, name in views]
    (first, sweep), rest = sweeps[0], sweeps[1:10]
    lines = [f"[**Per-chip TFLOPS of each strategy against chips: sweep {sweep}**]"
             f"({view_link(experiment_id, first)}), with speed-up over DDP, images/s and MFU", ""]
    if rest:
        lines += ["Earlier sweeps: " + " · ".join(f"[{name}]({view_link(experiment_id, view_id)})"
                                                  for view_id, name in rest), ""]
    lines.append("Every sweep's view is also under Runs → Views. (Written by rayvit after each scaling "
                 "sweep; once you edit this description, rayvit leaves it alone.)")
    text = "\n".join(lines)
    client.set_experiment_tag(experiment_id, TAG_NOTE, text)
    client.set_experiment_tag(experiment_id, TAG_RAYVIT_NOTE, text)
