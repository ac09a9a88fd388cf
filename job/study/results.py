"""A sweep's results, written once its study holds its N finished trials: the table, trials.csv, best.json, best/
(the best trial's model, usable as --model) and the picture of the metric against each parameter."""

from __future__ import annotations

import csv
import io
import json
from typing import TYPE_CHECKING, Any

from job.console import say
from job.errors import StorageError
from job.storage.cloud import read_url, write_url

if TYPE_CHECKING:
    from job.study.space import Space


def write_results(study, space: Space, output: str, rows: list[dict[str, Any]]) -> dict:
    """The results of `study` from its trials' `rows`; returns best.json ({} when no trial completed). Each worker
    that finds the study done writes them alike, each file whole."""
    import optuna

    out = output.rstrip("/")
    text = io.StringIO()
    fields = list(dict.fromkeys(k for r in rows for k in r))
    cost = sweep_cost(rows)
    total = {"trial": "total", "seconds": round(sum(r["seconds"] for r in rows), 1), **cost}
    writer = csv.DictWriter(text, fields)
    writer.writeheader()
    writer.writerows([*rows, total])
    write_url(f"{out}/trials.csv", text.getvalue().encode())
    print(table([*rows, total], fields[:-1]))
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        say(f"sweep {space.name}: no trial completed; results in {out}/trials.csv")
        return {}
    best_t = study.best_trial
    row = next(r for r in rows if r["run"] == best_t.user_attrs["run"])
    n = row["trial"]
    best = {
        "trial": n,
        "values": best_t.params,
        "metric": {space.metric: best_t.value},
        "run": best_t.user_attrs["run"],
        "cost": cost,  # the whole sweep's; the best trial's own:
        "trial_cost": {k: row[k] for k in ("device_hours", "spent", "lost_s")},
    }
    for name in ("model.pt", "model.json", "config.yaml"):
        data = read_url(f"{best['run']}/{name}")
        if data is None:
            raise StorageError(f"{best['run']}/{name}: missing from the best trial's run")
        write_url(f"{out}/best/{name}", data)
    write_url(f"{out}/best.json", (json.dumps(best, indent=1) + "\n").encode())
    write_url(f"{out}/params.png", picture(rows, space))
    say(
        f"sweep {space.name}: best trial {n}, {space.metric} {best_t.value:.4f} with "
        f"{', '.join(f'{k}={v}' for k, v in best_t.params.items())}; {out}/best.json, {out}/best/ (--model), "
        f"{out}/trials.csv, {out}/params.png"
    )
    return best


def sweep_cost(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's totals: device hours, spend (None where a trial's is unpriced), training lost to kills (seconds)."""
    spent = [r.get("spent") for r in rows]
    return {
        "device_hours": round(sum(r.get("device_hours") or 0.0 for r in rows), 6),
        "spent": None if None in spent or not rows else round(sum(spent), 6),
        "lost_s": round(sum(r.get("lost_s") or 0.0 for r in rows), 1),
    }


def table(rows: list[dict[str, Any]], fields: list[str]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)

    cells = [fields, *([cell(r.get(f)) for f in fields] for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(fields))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells)


def picture(rows: list[dict[str, Any]], space: Space) -> bytes:
    """The metric of each finished trial against each parameter, one panel a parameter (PNG), drawn with the run's
    own charts (Pillow): each range as searched (a log range on a log scale), a list of values a column each."""
    from job.sinks import pictures

    done = [r for r in rows if r[space.metric] is not None]
    ys = [r[space.metric] for r in done]
    panels = []
    for key, p in space.params.items():
        if isinstance(p, list):
            names = [str(v) for v in p]
            xs = [names.index(str(r[key])) for r in done]
            panels.append(pictures.scatter(xs, ys, "", key, space.metric, names=names))
        else:
            xs = [r[key] for r in done]
            panels.append(pictures.scatter(xs, ys, "", key, space.metric, log=p.log, span=(p.low, p.high)))
    return pictures.png(pictures.side_by_side(panels))
