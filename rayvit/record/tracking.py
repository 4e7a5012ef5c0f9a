"""MLflow records of sweeps: a parent run per sweep, a nested child run per point.

Where runs go (first that applies; :func:`rayvit.config.tracking_uri` resolves it):

1. ``tracking.uri`` in the config (or ``--set tracking.uri=...``): an explicit choice for this config;
2. ``$MLFLOW_TRACKING_URI``: the usual MLflow switch (a server, a cluster-wide store, a test's tmp store);
3. ``sqlite:///~/.rayvit/mlflow.db`` (``$RAYVIT_HOME`` moves it), created on first use.

Every local store is made absolute: Ray Train workers ``chdir`` into a session folder and
``ray job submit`` runs the driver in a temporary copy of the working directory, so a relative
``sqlite:///mlflow.db`` (MLflow's own default) would scatter results. MLflow's refused ``./mlruns``
file store is never used. Experiments created here in a sqlite store keep their artifacts beside the
database (``<db folder>/mlartifacts/<experiment>``), not under the current directory.

Only the driver talks to MLflow; workers never do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from rayvit.errors import TrackingError
from rayvit.formats import number as _number
from rayvit.record import views
from rayvit.record.run_writer import RunWriter
from rayvit.record.views import CURVE_X, TAG_KIND, TAG_SWEEP, quote
from rayvit.results import RunResult

# Tags that make runs filterable in the MLflow UI ("tags.rayvit.kind = 'point'").
# TAG_SWEEP ("rayvit.sweep") and TAG_KIND ("rayvit.kind": "sweep" parent, "point" child, "curve" one per
# strategy) come from rayvit.record.views, whose saved view filters on them.
TAG_POINT = "rayvit.point"        # a point's stable key within its sweep, e.g. "fsdp/w2"
TAG_HASH = "rayvit.config_hash"   # the point's measured settings; a changed config is rerun, not reused
TAG_ERROR = "rayvit.error"
TAG_PARENT = "mlflow.parentRunId"
TAG_SWEEP_RUN = "rayvit.sweep_run"  # a curve run's sweep (parent) run: curve runs are top-level runs
TAG_RUN_COLOUR = "mlflow.runColor"  # a run's colour in the UI's tables and charts
RESULT_ARTIFACT = "result.json"
ERROR_ARTIFACT = "error.txt"

# What the MLflow UI reads from an experiment's tags.
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"   # "Model training", not the GenAI views


# --------------------------------------------------------------------------------------------------
# Where runs go


def sqlite_path(uri: str) -> Optional[Path]:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def is_new_store(uri: str) -> bool:
    """Whether ``uri`` is a local sqlite store that does not exist yet (MLflow creates it on first use)."""
    db = sqlite_path(uri)
    return db is not None and not db.exists()


def ui_command(uri: str) -> str:
    """The command that browses ``uri``'s runs (or where to point a browser for a server)."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri} in a browser"
    return f"mlflow ui --backend-store-uri {uri}"


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Raise :class:`TrackingError` with the cause if ``uri`` cannot be used; create a local store."""
    db = sqlite_path(uri)
    if db is not None:
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"cannot create the MLflow store folder {db.parent}: {e}") from None
        if not os.access(db.parent, os.W_OK):
            raise TrackingError(f"the MLflow store folder {db.parent} is not writable")
    elif uri.startswith(("http://", "https://")):
        # MLflow's own client retries a dead server for minutes; ask its health endpoint once instead.
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise TrackingError(f"MLflow tracking server {uri} refused access ({e.code}): "
                                    "check MLFLOW_TRACKING_TOKEN / credentials") from None
            # Some proxies serve the API but not /health: the API call below decides.
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise TrackingError(
                f"cannot reach the MLflow tracking server at {uri} ({reason}); start it "
                f"(mlflow server --host 127.0.0.1 --port 5000) or set MLFLOW_TRACKING_URI / "
                "tracking.uri to a reachable store") from None
    try:
        _client(uri).search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 - any failure here means the store is unusable
        raise TrackingError(f"MLflow store {uri} is not usable: {type(e).__name__}: {e}") from None


def _client(uri: str):
    from mlflow import MlflowClient
    return MlflowClient(tracking_uri=uri)


def get_or_create_experiment(client, uri: str, name: str) -> str:
    """The id of experiment ``name``, creating it (artifacts beside a sqlite store) or restoring it.

    rayvit's experiments are model training: tagged so (``mlflow.experimentKind``) when created, and
    when an older one has no kind yet (a kind a user chose in the UI is left alone).
    """
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        if TAG_EXPERIMENT_KIND not in exp.tags:
            client.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
        return exp.experiment_id
    artifact_location = None
    db = sqlite_path(uri)
    if db is not None:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "experiment"
        artifact_location = (db.parent / "mlartifacts" / safe).as_uri()
    return client.create_experiment(name, artifact_location=artifact_location,
                                    tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND})


# --------------------------------------------------------------------------------------------------
# Environment facts recorded with every run


def git_commit() -> Optional[str]:
    """The rayvit checkout's commit (suffixed ``-dirty`` with local changes), or None outside git."""
    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None:
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=5)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment_tags() -> dict[str, str]:
    import platform

    import mlflow

    tags = {"mlflow_version": mlflow.__version__, "python_version": platform.python_version()}
    commit = git_commit()
    if commit:
        tags["git_commit"] = commit
        tags["mlflow.source.git.commit"] = commit.removesuffix("-dirty")
    return tags


# --------------------------------------------------------------------------------------------------
# Small helpers over the client


def curve_view_link(uri: str, experiment: str, sweep: str) -> Optional[str]:
    """The browser link to sweep ``sweep``'s chart view in the MLflow UI, once it has one (else None)."""
    try:
        return views.curve_view_link(_client(uri), uri, experiment, sweep)
    except Exception:  # noqa: BLE001 - only a hint for the user
        return None


class SweepTracker(RunWriter):
    """One sweep's MLflow records: its parent run, one child run per point, the curves (written as a
    :class:`~rayvit.record.run_writer.RunWriter` writes any run).

    Resuming is by name: a second tracker with the same experiment and sweep name adopts the
    existing parent run and reports which points already finished (:meth:`completed`).
    """

    def __init__(self, uri: str, experiment: str, sweep: str):
        client = _client(uri)
        super().__init__(client, get_or_create_experiment(client, uri, experiment))
        self.uri = uri
        self.experiment = experiment
        self.sweep = sweep
        self.parent_id: Optional[str] = None
        self.resumed = False
        self._env = environment_tags()

    # -- parent -------------------------------------------------------------------------------------

    def find_parent(self) -> Optional[str]:
        """The parent run of an earlier sweep of the same name, if any (changes nothing)."""
        found = self.search_runs(f"tags.`{TAG_SWEEP}` = {quote(self.sweep)} and tags.`{TAG_KIND}` = 'sweep'",
                             order_by=["attributes.start_time ASC"])
        if found:
            self.parent_id = found[0].info.run_id
            self.resumed = True
        return self.parent_id

    def start(self, params: Mapping[str, Any], tags: Mapping[str, Any], config_yaml: str) -> str:
        """Create the sweep's parent run, or reopen the existing one of the same name."""
        if self.parent_id or self.find_parent():
            self.client.update_run(self.parent_id, status="RUNNING")
        else:
            run = self.client.create_run(
                self.experiment_id, run_name=self.sweep,
                tags={TAG_SWEEP: self.sweep, TAG_KIND: "sweep", **self._env,
                      **{k: str(v) for k, v in tags.items()}})
            self.parent_id = run.info.run_id
            # Params are write-once in MLflow: only a new parent gets them; a resumed sweep keeps its
            # first values and records the config it was resumed with as an artifact instead.
            self.log(self.parent_id, params=params)
        self.client.log_text(self.parent_id, config_yaml, "config.yaml")
        return self.parent_id

    def end(self, status: str) -> None:
        self.client.set_terminated(self.parent_id, status=status)

    def set_parent_tags(self, tags: Mapping[str, Any]) -> None:
        self.log(self.parent_id, tags=tags)

    def log_parent_file(self, path: str | os.PathLike) -> None:
        self.client.log_artifact(self.parent_id, str(path))

    # -- points ---------------------------------------------------------------------------------------

    def completed(self) -> dict[str, tuple[str, RunResult, str]]:
        """``{point key: (run id, RunResult, config hash)}`` of this sweep's finished child runs."""
        if self.parent_id is None:
            return {}
        runs = self.search_runs(f"tags.`{TAG_PARENT}` = {quote(self.parent_id)} and "
                            f"tags.`{TAG_KIND}` = 'point' and attributes.status = 'FINISHED'",
                            order_by=["attributes.start_time DESC"])
        done: dict[str, tuple[str, RunResult, str]] = {}
        for run in runs:
            key = run.data.tags.get(TAG_POINT)
            if key is None or key in done:
                continue  # newest first: an older run of the same point is superseded
            try:
                result = self.load_result(run.info.run_id)
            except Exception:  # noqa: BLE001 - a finished run without its result is rerun
                continue
            done[key] = (run.info.run_id, result, run.data.tags.get(TAG_HASH, ""))
        return done

    def close_abandoned(self) -> list[str]:
        """Mark KILLED this sweep's child runs still RUNNING from a driver that died (SIGKILL, a lost head
        node): they never finish, and the rerun measures their points again. Returns their point keys."""
        if self.parent_id is None:
            return []
        runs = self.search_runs(f"tags.`{TAG_PARENT}` = {quote(self.parent_id)} and "
                            f"tags.`{TAG_KIND}` = 'point' and attributes.status = 'RUNNING'")
        for run in runs:
            self.fail_point(run.info.run_id, "the driver stopped before this point finished; the rerun of the "
                                             "sweep measured it again", status="KILLED")
        return [run.data.tags.get(TAG_POINT, "?") for run in runs]

    def load_result(self, run_id: str) -> RunResult:
        # Artifact downloads draw a progress bar by default: noise between progress lines.
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        with tempfile.TemporaryDirectory() as tmp:
            path = self.client.download_artifacts(run_id, RESULT_ARTIFACT, dst_path=tmp)
            with open(path) as f:
                return RunResult.from_dict(json.load(f))

    def start_point(self, name: str, key: str, config_hash: str, params: Mapping[str, Any],
                    tags: Mapping[str, Any]) -> str:
        """Open a child run for one point, with its flattened config as params."""
        run = self.client.create_run(
            self.experiment_id, run_name=name,
            tags={TAG_PARENT: self.parent_id, TAG_SWEEP: self.sweep, TAG_KIND: "point", TAG_POINT: key,
                  TAG_HASH: config_hash, **self._env, **{k: str(v) for k, v in tags.items()}})
        self.log(run.info.run_id, params=params)
        return run.info.run_id

    def finish_point(self, run_id: str, result: RunResult, step: int) -> None:
        """Record a run's outcome: summary figures (at ``step`` = chips), per-step history, conditions.

        Per-rank figures (``result.per_rank``) go in as ``<key>_by_rank`` with step = rank: one chart of
        the figure against rank in the run's page.
        """
        self.log(run_id, tags={k: v for k, v in result.conditions.items() if v is not None})
        self.log_metrics(run_id, result.metrics, step)
        self.log_history(run_id, [(f"{key}_by_rank", value, rank) for key, values in result.per_rank.items()
                                   for rank, value in enumerate(values)])
        history = [(key, entry[key], int(entry["step"])) for entry in result.history + result.evals
                   for key in entry if key != "step"]
        self.log_history(run_id, history)
        if result.restarts:
            self.log_metrics(run_id, {"restarts": result.restarts}, step)
        self.client.log_text(run_id, json.dumps(result.to_dict(), indent=1, default=str), RESULT_ARTIFACT)
        self.client.set_terminated(run_id, status="FINISHED")

    def fail_point(self, run_id: str, error: str, status: str = "FAILED") -> None:
        """Mark a child run failed (or KILLED), keeping the error in a tag and in full as an artifact."""
        self.log(run_id, tags={TAG_ERROR: error[-7900:] or "(no message)"})
        self.client.log_text(run_id, error, ERROR_ARTIFACT)
        self.client.set_terminated(run_id, status=status)

    # -- curves ---------------------------------------------------------------------------------------

    def log_curve_run(self, series: str, curves: Mapping[str, Mapping[int, Any]],
                      tags: Mapping[str, Any]) -> str:
        """One run per strategy holding its curves (``key -> {chips: value}``), replacing older ones.

        Curve runs are top-level runs (tagged with their sweep and its run, ``rayvit.sweep_run``), not
        children of the sweep's run: the MLflow UI folds children away under their parent, and so
        leaves them out of the experiment's charts. Side by side there (and in the sweep's saved view,
        :meth:`save_curve_view`) the same key from several curve runs is one chart: DDP and FSDP
        against chips.
        """
        # Also finds the nested curve runs earlier versions made (they carry the sweep tag too).
        for old in self.search_runs(f"tags.`{TAG_SWEEP}` = {quote(self.sweep)} and "
                                f"tags.`{TAG_KIND}` = 'curve' and tags.series = {quote(series)}"):
            self.client.delete_run(old.info.run_id)
        from rayvit.record.plots import strategy_colour  # the PNG's colour of each strategy, in the UI too

        shade = strategy_colour(series)
        colour = {TAG_RUN_COLOUR: shade} if shade is not None else {}
        run = self.client.create_run(
            self.experiment_id, run_name=f"{series} · {self.sweep}",
            tags={TAG_SWEEP_RUN: self.parent_id, TAG_SWEEP: self.sweep, TAG_KIND: "curve", "series": series,
                  **colour, **self._env, **{k: str(v) for k, v in tags.items()}})
        entries = [(key, value, int(chips)) for key, points in curves.items()
                   for chips, value in sorted(points.items())]
        # The x-axis of the saved view's charts: "chips" at step = chips.
        chips = sorted({step for key, value, step in entries if _number(value) is not None})
        self.log_history(run.info.run_id, entries + [(CURVE_X, n, n) for n in chips])
        self.client.set_terminated(run.info.run_id, status="FINISHED")
        return run.info.run_id

    def save_curve_view(self, keys: Iterable[str], bands: Iterable[str] = ()) -> str:
        """Save (or refresh) this sweep's chart view of the experiment's Runs page and link it in the
        experiment's description (:func:`rayvit.record.views.save_curve_view`); returns its id."""
        return views.save_curve_view(self.client, self.experiment_id, self.sweep, keys, bands)
