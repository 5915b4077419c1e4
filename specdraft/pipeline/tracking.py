"""Experiment tracking: a small interface over MLflow, plus a no-op tracker for tests.

Default store: ``sqlite:///mlruns/mlflow.db`` with artifacts under ``mlruns/`` (the file store is refused by MLflow
3.17). ``MLFLOW_TRACKING_URI`` wins when set; ``tracking.uri`` in the config wins over both.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

from specdraft.noise import quiet_mlflow_store
from specdraft.pipeline.config import TrackingConfig

_SECRET = re.compile(r"(token|secret|password|api_key|apikey)", re.I)


def resolve_tracking_uri(cfg: TrackingConfig) -> str:
    if cfg.uri:
        return cfg.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    Path("mlruns").mkdir(exist_ok=True)
    return f"sqlite:///{Path('mlruns').resolve() / 'mlflow.db'}"


def redact(params: dict) -> dict:
    return {k: ("***" if _SECRET.search(k) else v) for k, v in params.items()}


class Tracker:
    """No-op tracker: the interface every tracker implements."""

    run_id: str | None = None
    tracking_uri: str | None = None
    experiment: str = "specdraft"

    @contextlib.contextmanager
    def run(self, name: str, nested: bool = False, tags: dict | None = None) -> Iterator["Tracker"]:
        yield self

    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict, step: int | None = None) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: dict) -> None: ...

    def register_model(self, artifact_path: str, name: str, tags: dict | None = None) -> str | None:
        return None


class MLflowTracker(Tracker):
    def __init__(self, cfg: TrackingConfig):
        import mlflow  # noqa: PLC0415  (deferred: seconds to import, and not needed when tracking is disabled)

        quiet_mlflow_store()
        self._mlflow = mlflow
        self.tracking_uri = resolve_tracking_uri(cfg)
        self.experiment = cfg.experiment
        mlflow.set_tracking_uri(self.tracking_uri)
        if mlflow.get_experiment_by_name(cfg.experiment) is None:
            artifacts = None
            if self.tracking_uri.startswith("sqlite:"):
                artifacts = (Path("mlruns") / "artifacts").resolve().as_uri()
            mlflow.create_experiment(cfg.experiment, artifact_location=artifacts)
        mlflow.set_experiment(cfg.experiment)

    @contextlib.contextmanager
    def run(self, name: str, nested: bool = False, tags: dict | None = None) -> Iterator["MLflowTracker"]:
        parent = self.run_id
        with self._mlflow.start_run(run_name=name, nested=nested or parent is not None, tags=tags) as r:
            self.run_id = r.info.run_id
            try:
                yield self
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through the CLI's handler: the run was stopped
                self._mlflow.end_run(status="KILLED")
                raise
            finally:
                self.run_id = parent

    def log_params(self, params: dict) -> None:
        clean = {k: str(v)[:5000] for k, v in redact(params).items()}
        items = list(clean.items())
        for i in range(0, len(items), 90):
            self._mlflow.log_params(dict(items[i:i + 90]))

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self._mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            self._mlflow.log_artifacts(str(p), artifact_path=artifact_path)
        else:
            self._mlflow.log_artifact(str(p), artifact_path=artifact_path)

    def set_tags(self, tags: dict) -> None:
        self._mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def register_model(self, artifact_path: str, name: str, tags: dict | None = None) -> str | None:
        """Register this run's ``artifact_path`` folder (an HF-format drafter) as a new version of model ``name``."""
        client = self._mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        try:
            client.get_registered_model(name)
        except self._mlflow.exceptions.MlflowException:
            client.create_registered_model(name, description="specdraft drafters (HF-format directories)")
        source = f"{client.get_run(self.run_id).info.artifact_uri}/{artifact_path}"
        mv = client.create_model_version(name, source=source, run_id=self.run_id,
                                         tags={k: str(v) for k, v in (tags or {}).items()})
        return str(mv.version)


def is_rank_zero() -> bool:
    """Whether this is the first process of a multi-process job (or the only one). Lightning's DDP launcher re-runs
    the command in the other processes with ``LOCAL_RANK``/``NODE_RANK`` set; torchrun sets ``RANK``."""
    return all(int(os.environ.get(k, "0") or 0) == 0 for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def make_tracker(cfg: TrackingConfig) -> Tracker:
    """MLflow when enabled, on the first process only: one run per job, however many processes train."""
    return MLflowTracker(cfg) if cfg.enabled and is_rank_zero() else Tracker()
