"""`shard`: an image folder or a manifest's images packed into tar shards (job/data/pack.py)."""

from __future__ import annotations

import typer

from job.cli.faults import user_errors


def shard(
    src: str = typer.Argument(
        ...,
        help="An image folder (class folders, or train/ val/ test/ folders of them), a .tar/.tar.gz of one, or a "
        "manifest (.csv, .jsonl: a column of image paths and one of labels), at any URL.",
    ),
    dst: str = typer.Argument(
        ..., help="The shard folder to write, at any URL (train/*.tar, val/*.tar, test/*.tar, classes.txt)."
    ),
    shard_size: str = typer.Option("256MB", "--shard-size", help="Largest shard, e.g. 256MB or 1GB."),
    samples_per_shard: int = typer.Option(1000, "--samples-per-shard", help="Most samples in one shard."),
    seed: int = typer.Option(0, "--seed", help="Seed of the shuffle across shards."),
    val_split: float = typer.Option(
        0.1, "--val-split", min=0, max=0.99, help="Share of each class held out for val where SRC has no val/."
    ),
    test_split: float = typer.Option(
        0.0, "--test-split", min=0, max=0.99, help="Share of each class held out for test where SRC has no test/."
    ),
    split_seed: int = typer.Option(42, "--split-seed", help="Seed of the held-out files (a hash of each path)."),
    path_column: str = typer.Option("path", "--path-column", help="A manifest's column of image paths."),
    label_column: str = typer.Option("label", "--label-column", help="A manifest's column of labels."),
    split_column: str = typer.Option(
        "split", "--split-column", help="A manifest's column of splits (train, val, test), where it has one."
    ),
) -> None:
    """Pack an image folder or a manifest's images into WebDataset-style tar shards, shuffled, for streaming
    (data.kind=shards); files that cannot be decoded or are not there are skipped and listed in index.json."""
    with user_errors():
        from job.console import say
        from job.data.items import Columns
        from job.data.pack import pack, parse_size
        from job.data.split import HoldOut

        hold = HoldOut(val_split, test_split, split_seed)
        columns = Columns(path_column, label_column, split_column)
        size = parse_size(shard_size)
        pack(src, dst, say, shard_bytes=size, shard_samples=samples_per_shard, seed=seed, hold=hold, columns=columns)
