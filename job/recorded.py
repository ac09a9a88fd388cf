"""The scores an evaluation writes to metrics.jsonl for a split, named once: the records (job/use/evaluate.py's Scored,
job/recipe/multilabel.py's MultiScored) take their keys from here, and a sweep checks its metric against them before any
work, without reading data."""

from __future__ import annotations

AVERAGED = tuple(f"{avg}_{name}" for name in ("precision", "recall", "f1") for avg in ("macro", "weighted"))
SINGLE_LABEL = ("loss", "accuracy", *AVERAGED)
TOP5 = "top5"  # written only for more than 5 classes: below, every label is in the top 5
MULTI_LABEL = ("loss", "map", "micro_f1", "macro_f1", "exact_match")


def split_scores(multilabel: bool, classes: int) -> tuple[str, ...]:
    """What an evaluation of a split writes, after the split's name, for a task and its number of classes."""
    if multilabel:
        return MULTI_LABEL
    return (*SINGLE_LABEL, TOP5) if classes > 5 else SINGLE_LABEL


def possible_scores(multilabel: bool | None, classes: int | None) -> tuple[str, ...]:
    """split_scores where the task or the number of classes is known before the data is read (None: not known), else
    all that it may write."""
    tasks = [False, True] if multilabel is None else [multilabel]
    counts = [0, 6] if classes is None else [classes]
    return tuple(dict.fromkeys(s for task in tasks for n in counts for s in split_scores(task, n)))
