"""A sweep's study in MLflow: one run that every worker of the study agrees on, holding the space, the metric and its
direction, and at the end the best trial's params and value and the results' files; each trial's run is its child."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from job.console import say
from job.sinks.track_server import client, experiment_id

if TYPE_CHECKING:
    from job.sinks.track_server import Target

Space = Any  # a sweep's Space (job/study/space.py), read by its fields: a sink never imports the study

STUDY_TAG = "job.study"  # a sweep study's identity: its workers find the study's one MLflow run by it
RESULTS = ("trials.csv", "best.json", "params.png")  # the results' files the study's run keeps (job/study/results.py)


def study_run(where: Target, space: Space, study: str) -> str:
    """The MLflow run of a sweep's study, tagged job.study with `study` (an identity safe in a filter): the one run
    every worker of the study agrees on, made by the first. Workers that start together may each make one; each then
    looks again and keeps the earliest made (start time, then run id), a later one deleting its own. (Two whose
    requests cross within one round trip could still each keep their own: both then see both on a later search.)
    '' when the server does not answer (said at once: the client does not retry): each trial is then tracked alone."""
    try:
        c = client(where.uri)  # mlflow whole first: its entities alone, imported beside preload's thread, are not safe
        from mlflow.entities import Param

        exp = experiment_id(c, where)
        if not (found := study_runs(c, exp, study)):
            tags = {STUDY_TAG: study, "job.study_name": space.name}
            name = space.name.replace("'", "\\'")
            if c.search_runs([exp], f"attributes.run_name = '{name}'", max_results=1):  # another sweep's of that name
                name = f"{space.name}-{study[:6]}"  # its trials are named after it: <study>-<n> must not collide
            else:
                name = space.name
            made = c.create_run(exp, run_name=name, tags=tags).info.run_id
            found = study_runs(c, exp, study)
            if found[0] != made:
                c.delete_run(made)
        held = c.get_run(found[0]).data.params
        if new := {k: v for k, v in space_params(space).items() if k not in held}:
            c.log_batch(found[0], params=[Param(k, v) for k, v in new.items()])
        return found[0]
    except Exception as e:  # the client's and the server's errors
        from job.sinks.track import one_line

        say(f"tracking: no MLflow run for the study at {where.uri} ({one_line(e)}); each trial is tracked alone")
        return ""


def space_params(space: Space) -> dict[str, str]:
    """The study's settings as params: sweep.metric, sweep.direction, sweep.trials, sweep.sampler, sweep.pruner and
    each searched key as sweep.space.KEY (a list as JSON, a range as {"low", "high", "log"})."""
    out = {"sweep.metric": space.metric, "sweep.direction": space.direction, "sweep.trials": str(space.trials)}
    out |= {"sweep.sampler": f"{space.sampler} (seed {space.seed})", "sweep.pruner": space.pruner}
    for key, p in space.params.items():
        value = p if isinstance(p, list) else {"low": p.low, "high": p.high, "log": p.log}
        out[f"sweep.space.{key}"] = json.dumps(value)
    return out


def study_runs(c, experiment: str, study: str) -> list[str]:
    """The ids of the study's runs not deleted, the earliest made first."""
    runs = c.search_runs([experiment], filter_string=f"tags.`{STUDY_TAG}` = '{study}'")
    return [r.info.run_id for r in sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))]


def end_study_run(where: Target, run_id: str, best: dict[str, Any], output: str) -> None:
    """The study's MLflow run finished: the best trial (best.json's) with its params as best.KEY and its value as
    best_<metric>, one point however many workers end it (a new one where a study given more trials found a better
    one), and the results' files in `output`, as they now are."""
    from job.storage.cloud import read_url

    try:
        c = client(where.uri)
        from mlflow.entities import Metric, Param

        run = c.get_run(run_id)
        params = {f"best.{k}": str(v) for k, v in best.get("values", {}).items()}
        params["best.trial"] = str(best.get("trial", ""))
        items = [Param(k, v) for k, v in params.items() if k not in run.data.params]
        metrics = [Metric(f"best_{k}", v, int(time.time() * 1000), 0) for k, v in best.get("metric", {}).items()]
        metrics = [m for m in metrics if run.data.metrics.get(m.key) != m.value]
        if items or metrics:
            c.log_batch(run_id, metrics=metrics, params=items)
        c.set_tag(run_id, "job.best_trial", str(best.get("trial", "")))
        with tempfile.TemporaryDirectory(prefix="job-track-") as tmp:
            for name in RESULTS:  # each worker that ends the study writes them alike: the last upload stands
                if (data := read_url(f"{output.rstrip('/')}/{name}")) is None:
                    continue
                (Path(tmp) / name).write_bytes(data)
                c.log_artifact(run_id, str(Path(tmp) / name))
        c.set_terminated(run_id)
    except Exception as e:  # the client's and the server's errors
        from job.sinks.track import one_line

        say(f"tracking: the study's MLflow run could not be ended ({one_line(e)})")
