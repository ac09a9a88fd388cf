"""output and track: the run folder's URL and how it is sent, and the MLflow server a run is tracked on."""

from __future__ import annotations

import warnings

from pydantic import Field, field_validator

from job.config.section import Section


class OutputConfig(Section):
    dir: str = Field(
        "",
        description="URL of the run folder; --output overrides it. Default: Vertex AI's AIP_CHECKPOINT_DIR when "
        "set, else ./runs/<name>.",
    )
    staged: bool = Field(
        False,
        description="Also stage a local output folder and copy files to it in the background, as for a remote URL: "
        "for a Google Drive mount in Colab, which syncs appended and rewritten files slowly.",
    )
    sync_every_seconds: float = Field(
        30.0, gt=0, description="Remote runs: send new TensorBoard events at least this often (also at checkpoints)."
    )
    upload_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="Remote runs: give up when a file has not reached the store this long after its first try (plus "
        "a second per MiB of it), retries included; the run then exits 4 with its checkpoints kept locally, and the "
        "same command continues it and sends them.",
    )


# The key is track.register, as users write it; pydantic warns that it hides BaseModel.register, used by no config.
warnings.filterwarnings("ignore", 'Field name "register" in "TrackConfig"')


class TrackConfig(Section):
    mlflow: str = Field(
        "",
        description="MLflow tracking URI: http(s)://HOST:PORT or sqlite:///PATH; empty: the environment's "
        "MLFLOW_TRACKING_URI, else no tracking. What the server does not take waits in the run folder "
        "(track.jsonl) and is sent when it answers again, or by `python -m job track RUN`.",
    )
    experiment: str = Field("", description="The MLflow experiment; default: the config's name.")
    log_model: bool = Field(True, description="Send the chosen model (model.pt, model.json) as the artifact `model`.")
    register: str = Field(
        "",
        description="Register the chosen model as a new version of this name in the MLflow Model Registry, tagged "
        "with its val metrics.",
    )
    hp_metric_tag: str = Field(
        "val_accuracy",
        description="Under Vertex AI hyperparameter tuning (CLOUD_ML_TRIAL_ID or CLOUD_ML_HP_METRIC_FILE set): the "
        "metrics.jsonl key reported at each evaluation, in cloudml-hypertune's format, to $CLOUD_ML_HP_METRIC_FILE "
        "(default /tmp/hypertune/output.metrics); the study's metricId.",
    )
    parent_run_id: str = Field(
        "", description="Make the run's MLflow run a child of this MLflow run (a sweep sets it: its study's run)."
    )

    @field_validator("mlflow")
    @classmethod
    def _uri(cls, v: str) -> str:
        return tracking_uri(v) if v else v


def tracking_uri(uri: str) -> str:
    """A tracking URI the MLflow client can open, as given; a ValueError naming what is wrong. The one reading of it,
    for track.mlflow and the environment's MLFLOW_TRACKING_URI alike."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise ValueError("names no host (http://HOST:PORT)")
        try:
            parts.port  # noqa: B018  (a port that is no number raises here)
        except ValueError:
            raise ValueError("has a port that is no number") from None
    elif parts.scheme in ("sqlite", "postgresql", "mysql", "mssql"):
        if not parts.path.strip("/") and parts.scheme == "sqlite":
            raise ValueError("names no database file (sqlite:///PATH)")
    elif parts.scheme != "databricks":  # MLflow 3 retired its folder store: a path is a typo or that store
        raise ValueError("expected http(s)://HOST:PORT (a tracking server) or sqlite:///PATH (a database file)")
    return uri
