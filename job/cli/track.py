"""`track`: what a tracked run's MLflow server lacks, sent from the run folder (job/sinks/track.py)."""

from __future__ import annotations

import typer

from job.cli.faults import user_errors


def track(
    run: str = typer.Argument(..., help="The run folder, at any URL."),
    mlflow: str = typer.Option("", "--mlflow", help="The tracking server; default: the one the run was tracked in."),
) -> None:
    """Send what a tracked run's MLflow server lacks (points, params, files, status, model version), kept in the
    run's track.jsonl while the server could not take it. As often as you like: nothing is sent twice."""
    with user_errors():
        from job.console import say
        from job.errors import StorageError
        from job.sinks.track import send_run
        from job.storage.run_folder import RunDir

        line, sent = send_run(RunDir(run), mlflow or None)
        if not sent:
            raise StorageError(line)
        say(line)
