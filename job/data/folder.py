"""Image folders held in memory: class folders at the top, or train/ val/ test/ folders of them (job/data/split.py
sorts the files and holds splits out), as a folder at any URL or a .tar/.tar.gz of one. Every image is decoded the
one way job/data/image.py gives (EXIF turn, HEIC, every mode to RGB); a file that cannot be decoded is skipped and
named (a run's data.json lists them all), or stops the run with data.skip_bad_samples false."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from job.data.dataset import Dataset, Split
from job.data.files import Log, Source, images_listed, read_entries, source
from job.data.formats import Format
from job.data.image import UnreadableImage, pixels
from job.data.items import SHOWN, report_skipped
from job.data.placement import decoded_size
from job.data.preprocess import Preprocess
from job.data.split import (
    ROLES,
    SUFFIXES,
    Files,
    HoldOut,
    Inventory,
    across_classes,
    count,
    kind_of,
    label_names,
    sort_files,
)
from job.errors import ConfigError, DataError, StorageError
from job.storage.cloud import describe_storage_error, filesystem

LAYOUT = f"<class>/*.{SUFFIXES} or train/<class>/*.{SUFFIXES}"


@dataclass
class Listing:
    """The files a reader was offered that are neither images nor system files, counted for one line."""

    others: list[str] = field(default_factory=list)

    def keep(self, name: str) -> bool:
        kind = kind_of(name)
        if kind == "other":
            self.others.append(name)
        return kind == "image"

    def report(self, url: str, files: Files, log: Log) -> None:
        if self.others:
            n = len(self.others)
            which = f"{n} files in {url} are not images" if n > 1 else f"1 file in {url} is not an image"
            log(f"data: {which} ({SUFFIXES}), e.g. {self.others[0]}: ignored")
        if files.outside:
            where = "a train/, val/ or test/ class folder" if files.folders else "a class folder"
            log(f"data: {len(files.outside)} images are in no {where}, e.g. {files.outside[0]}: ignored")


def sorted_files(names: list[str], hold: HoldOut, url: str) -> Files:
    """The images sorted into classes and splits; a layout with nothing to train or evaluate on is named."""
    files = sort_files(names, hold)
    check_files(files, files.classes(), url)
    return files


def check_files(files: Files, classes: list[str], url: str) -> None:
    if not files.roles["train"]:
        raise DataError(f"{url}: no images in the {LAYOUT} layout")
    if not files.roles["val"] and not files.roles["test"]:
        n = len(files.roles["train"])
        raise ConfigError(
            f"{url}: nothing to evaluate on: no val/ or test/ folder, and none of its {n} image files fell in a "
            "held-out share: set data.val_split (0.1 or 0.2 holds out that share of each class; the iris and "
            "cifar10 presets set 0), or add a val/ folder"
        )
    for role in ("val", "test"):
        unknown = sorted({c for _, label in files.roles[role] for c in label_names(label)} - set(classes))
        if unknown:
            raise DataError(f"{url}: {role} classes without training images: {', '.join(unknown[:5])}")
    if len(classes) < 2 and not files.multilabel:  # multi-label: one class is a yes/no question
        raise DataError(f"{url}: one class ({classes[0]}): a classifier needs images of two classes or more")


def load_folder(cfg, cache: Path | None, log: Log, src: Source | None = None) -> Dataset:
    """The images at cfg.path (`src`: it resolved, where the caller has); remote data are kept in the folder `cache`
    (None: no cache)."""
    url, listing = cfg.path, Listing()
    entries = dict(read_entries(src or source(url), listing.keep, cache, log))
    files = sorted_files(sorted(entries), HoldOut.of(cfg), url)
    listing.report(url, files, log)
    return held(files, entries.__getitem__, files.classes(), cfg, url, f"folder {url}", log)


def held(
    files: Files,
    content: Callable[[str], bytes],
    classes: list[str],
    cfg,
    url: str,
    source: str,
    log: Log,
    skipped: list[dict[str, str]] | None = None,
    scoring: bool = False,
    pre: Preprocess | None = None,
) -> Dataset:
    """The files decoded into memory, each split's images in one tensor; `content`: a file's bytes by its name;
    `skipped`: files already found missing, to which those that cannot be decoded are added; `scoring`: images a
    trained model is scored on, which need nothing to train on; `pre`: how they are held (default: as cfg says)."""
    pre = pre or Preprocess.of(cfg)
    skipped = [] if skipped is None else skipped
    strict, multilabel = cfg.skip_bad_samples, files.multilabel
    splits = {
        role: decode_split(files.roles[role], content, classes, pre, url, skipped, strict, multilabel) for role in ROLES
    }
    report_skipped(skipped, log)
    shapes = {role: tuple(s.x.shape[1:]) for role, s in splits.items() if len(s)}
    if len(set(shapes.values())) > 1:
        shown = ", ".join(f"{role} images {shape[1:]}" for role, shape in shapes.items())
        raise DataError(f"{url}: {shown}; set data.image_size")
    if not len(splits["train"]) and not scoring:
        raise DataError(f"{url}: no training image could be decoded")
    bad = {s["path"] for s in skipped}
    held_out = {role: [n for n in names if n not in bad] for role, names in files.held_out.items()}
    if files.multilabel:  # an image counts once in its split, and once for each class it shows
        counts = {role: dict(zip(classes, s.y.sum(0).long().tolist())) for role, s in splits.items() if len(s)}
        images = {role: len(s) for role, s in splits.items() if len(s)}
        inventory = Inventory(classes, counts, held_out, skipped, images)
    else:
        counts = {role: count(s.y.tolist(), classes) for role, s in splits.items() if len(s)}
        inventory = Inventory(classes, counts, held_out, skipped)
    for line in inventory.lines():
        log(line)
    val, test = (splits[r] if len(splits[r]) else None for r in ("val", "test"))
    if val is None and test is None and not scoring:
        raise DataError(f"{url}: no held-out image could be decoded")
    if len(skipped) > SHOWN and not scoring:  # only now: a run that stops at reading writes no data.json
        log(f"data: data.json lists the {len(skipped)} files skipped")
    return Dataset(splits["train"], test, classes, source, val=val, inventory=inventory)


def targets(labels: list, classes: list[str], multilabel: bool = False) -> torch.Tensor:
    """Labels as a model's targets: class indexes (int64 N), or multi-label tuples of names as float32 N x classes
    of 0 and 1."""
    index = {c: i for i, c in enumerate(classes)}
    if not multilabel:
        return torch.tensor([index[label] for label in labels])
    y = torch.zeros(len(labels), len(classes))
    for i, names in enumerate(labels):
        y[i, [index[c] for c in names]] = 1.0
    return y


def decode_split(
    items: list[tuple[str, str]],
    content: Callable[[str], bytes],
    classes: list[str],
    pre: Preprocess,
    url: str,
    skipped: list[dict[str, str]] | None = None,
    skip: bool = True,
    multilabel: bool = False,
) -> Split:
    """Decode the images (name, class) to uint8 3 x H x W, in threads (Pillow's decoders release the GIL). A file
    that cannot be decoded is appended to `skipped` (skip) or stops the reading in one line naming it. `multilabel`:
    each class a tuple of names, y float32 N x classes of 0 and 1 (multi-hot)."""

    def one(name: str) -> torch.Tensor | UnreadableImage:
        try:
            return torch.from_numpy(pixels(content(name), name, pre).transpose(2, 0, 1).copy())
        except UnreadableImage as e:
            if not skip:
                raise DataError(f"{url}: {e} (data.skip_bad_samples is false)") from None
            return e

    empty_y = torch.zeros(0, len(classes)) if multilabel else torch.empty(0, dtype=torch.int64)
    if not items:
        return Split(torch.empty(0, 3, *(pre.size or (0, 0)), dtype=torch.uint8), empty_y)
    chunks = [items[i : i + 256] for i in range(0, len(items), 256)]
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    try:
        decoded = [img for chunk in pool.map(lambda c: [one(n) for n, _ in c], chunks) for img in chunk]
    except BaseException:  # a bad file or a signal (stop.at_once): the chunks not begun are dropped, not decoded
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    good = [(img, cls, name) for img, (name, cls) in zip(decoded, items) if isinstance(img, torch.Tensor)]
    for bad in decoded:
        if isinstance(bad, UnreadableImage) and skipped is not None:
            skipped.append({"path": bad.name, "reason": bad.reason})
    shapes = {img.shape for img, _, _ in good}
    if len(shapes) > 1:
        first = good[0][0].shape
        odd = next(name for img, _, name in good if img.shape != first)
        raise DataError(
            f"{url}: images differ in size ({tuple(first[1:])} and {tuple(shapes.difference({first}).pop()[1:])}, "
            f"e.g. {odd}); set data.image_size"
        )
    if not good:
        return Split(torch.empty(0, 3, *(pre.size or (0, 0)), dtype=torch.uint8), empty_y)
    x, y = torch.stack([img for img, _, _ in good]), targets([cls for _, cls, _ in good], classes, multilabel)
    return Split(x, y, [name for _, _, name in good])


class FolderItems:
    """An image folder's (or archive's) images as packing reads them: their bytes first, then sorted into classes and
    splits by the paths of those that decoded."""

    def __init__(self, src: Source, hold: HoldOut, columns, log: Log) -> None:
        self.src, self.hold, self.log, self.listing = src, hold, log, Listing()

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        return iter(read_entries(self.src, self.listing.keep, None, self.log))

    def sorted(self, kept: list[str]) -> tuple[Files, list[str], list[dict[str, str]]]:
        files = sorted_files(kept, self.hold, self.src.url)
        self.listing.report(self.src.url, files, self.log)
        return files, files.classes(), []


def load(cfg, cache: Path | None, log: Log, src: Source | None = None, started=None) -> Dataset:
    return load_folder(cfg, cache, log, src)


def scored(cfg, log: Log, classes: list[str], pre: Preprocess) -> Dataset:
    """Every image of a folder (or archive) a model is scored on, split by its folders (none held out)."""
    url, listing = cfg.path, Listing()
    entries = dict(read_entries(source(url), listing.keep, None, log))
    files = sort_files(sorted(entries), HoldOut(0.0, 0.0, cfg.split_seed))
    unknown = sorted({c for role in files.roles.values() for _, c in role} - set(classes))
    if unknown:
        raise DataError(f"{url}: classes the model does not know: {', '.join(unknown[:5])}")
    return held(files, entries.__getitem__, classes, cfg, url, f"folder {url}", log, scoring=True, pre=pre)


def held_out(cfg, limit: int) -> list[str]:
    """Up to `limit` of the run's val (else test) images, sorted as the run sorted them, from every class in turn."""
    fs, path = filesystem(cfg.path)
    try:
        if not fs.isdir(path):
            raise DataError(f"{cfg.path} is not a folder here")
        root = path.rstrip("/") + "/"
        names = [p[len(root) :] for p in fs.find(path) if kind_of(p[len(root) :]) == "image"]
    except DataError:
        raise
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot list {cfg.path}: {describe_storage_error(cfg.path, e)}") from None
    files = sort_files(names, HoldOut.of(cfg))
    return [f"{cfg.path.rstrip('/')}/{n}" for n in across_classes(files.roles["val"] or files.roles["test"], limit)]


FORMAT = Format(
    "folder",
    load,
    about="image folders (class folders, or train/ val/ test/ folders of them), or a .tar/.tar.gz of one",
    items=FolderItems,
    listed=lambda src, columns: images_listed(src),
    decoded_size=decoded_size,
    scored=scored,
    held_out=held_out,
)
