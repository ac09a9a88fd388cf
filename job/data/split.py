"""Which files are a data set's images, which class each is, and which split it falls in; torch-free.

Layouts: `train/ val/ test/` folders of class folders (val and test each optional; `valid/` and `validation/` are
read as val/), or class folders at the top with no split. Images anywhere below a class folder count for it (phones
nest them by date: DCIM/100APPLE/). An archive whose members all lie in one top folder is read from inside it.

A split the folders do not give is held out by hash: a file goes to val when a hash of (data.split_seed, its path
relative to the data folder) falls below data.val_split, to test when it falls in the next data.test_split. Each
file's split is a function of its own name alone (not a shuffle of the list), so adding photos never moves one
already there, and every run, resume and machine sees the same split; each class gets about that share (the
hash is uniform whatever the class).

System files (.DS_Store, ._*, Thumbs.db, desktop.ini, @eaDir/, __MACOSX/) are ignored silently; other files that
are not images are counted for one line.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass, field

# What the readers take for an image, by suffix in any case; every other file is counted as not an image.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".heic", ".heif", ".avif", ".bmp", ".tif", ".tiff", ".gif")
SUFFIXES = "|".join(s.lstrip(".") for s in IMAGE_SUFFIXES)  # as messages name them: jpg|jpeg|png|...
SYSTEM_FILES = {".ds_store", "thumbs.db", "desktop.ini", "ehthumbs.db", "icon\r"}
SPLIT_FOLDERS = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "test"}
ROLES = ("train", "val", "test")
IMBALANCE = 10  # a warning when the largest class has this many times the smallest's images


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def is_system_file(name: str) -> bool:
    """Files an operating system or a NAS leaves beside photos: hidden files (.DS_Store, macOS's ._ twins),
    Thumbs.db, desktop.ini, and anything in @eaDir/ or __MACOSX/."""
    return kind_of(name) == "system"


def kind_of(name: str) -> str:
    """system (see is_system_file), image (by suffix, in any case), or other."""
    path = name.lower()
    if "\\" in path:
        path = path.replace("\\", "/")
    if "./" in path:  # tar -C folder . names every member ./...: not hidden
        path = path.removeprefix("./").replace("/./", "/")
    if path.startswith(".") or "/." in path or path[path.rfind("/") + 1 :] in SYSTEM_FILES:
        return "system"
    if "@eadir/" in path or "__macosx/" in path or "$recycle.bin/" in path or "system volume information/" in path:
        return "system"
    return "image" if path.endswith(IMAGE_SUFFIXES) else "other"


@dataclass(frozen=True)
class HoldOut:
    """The shares held out of a training split that the data does not split itself, and the seed of their hash."""

    val: float = 0.1
    test: float = 0.0
    seed: int = 42

    @classmethod
    def of(cls, cfg) -> HoldOut:
        """data.val_split, data.test_split (none unless set, for files) and data.split_seed."""
        return cls(cfg.val_split, cfg.test_split or 0.0, cfg.split_seed)

    def roles(self) -> Roles:
        return Roles(self.seed, self.val, self.test)

    def lacking(self, val: bool, test: bool) -> HoldOut | None:
        """The shares held out where the data lacks a split of its own (`val`, `test`: it has none), or None when
        nothing is held out: a split the data has is never added to."""
        shares = HoldOut(self.val if val else 0.0, self.test if test else 0.0, self.seed)
        return shares if shares.val or shares.test else None


class Roles:
    """train, val or test for a sample with no split of its own, by its key: the first 8 bytes of BLAKE2b of
    "<seed>\\0<key>", read big-endian, below val * 2^64 is val, below (val + test) * 2^64 test. The seed's part of the
    hash is computed once, and compared as integers (a million names take about half a second)."""

    def __init__(self, seed: int, val: float, test: float) -> None:
        self.seeded = hashlib.blake2b(f"{seed}\0".encode(), digest_size=8)
        self.val, self.test = int(val * 2**64), int((val + test) * 2**64)

    def __call__(self, key: str) -> str:
        h = self.seeded.copy()
        h.update(key.encode())
        u = int.from_bytes(h.digest(), "big")
        return "val" if u < self.val else "test" if u < self.test else "train"


@dataclass
class Files:
    """Image files sorted into roles: (relative name, class) per role; what was passed over, counted."""

    roles: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: {r: [] for r in ROLES})
    held_out: dict[str, list[str]] = field(default_factory=lambda: {"val": [], "test": []})
    outside: list[str] = field(default_factory=list)  # images in no class folder
    folders: tuple[str, ...] = ()  # the split folders the data has (empty: class folders at the top)
    multilabel: bool = False  # each file's label a tuple of class names (any number, none included)

    def classes(self) -> list[str]:
        """The classes, sorted: those with training images (a split folder layout), or all (class folders)."""
        if self.folders:
            return sorted({c for _, c in self.roles["train"]})
        return sorted({c for role in ROLES for _, c in self.roles[role]})


def label_names(label: str | tuple[str, ...]) -> tuple[str, ...]:
    """The class names of a file's label: its one class, or a multi-label file's tuple of them."""
    return label if isinstance(label, tuple) else (label,)


def sort_files(names: list[str], hold: HoldOut) -> Files:
    """Image names (relative to the data folder or archive) sorted into classes and roles; see the module's doc."""
    ordered = sorted(names)
    prefix = ""  # an archive of one top folder: read from inside it
    while ordered:
        heads = first_folders(ordered, len(prefix))
        if len(heads) != 1 or heads[0].lower() in SPLIT_FOLDERS:
            break
        inside = f"{prefix}{heads[0]}/"
        if not all(n.startswith(inside) and n.count("/", len(inside)) >= 1 for n in ordered):
            break  # images directly in the folder: it is the class folder, not a wrapper around them
        prefix = inside
    cut, files = len(prefix), Files()
    tops = {h.lower() for h in first_folders(ordered, cut, deep=True)}
    files.folders = tuple(r for r in ROLES if r in {SPLIT_FOLDERS[t] for t in tops if t in SPLIT_FOLDERS})
    lacking = hold.lacking("val" not in files.folders, "test" not in files.folders)
    carve = lacking.roles() if lacking is not None else None
    roles, held_out, outside, split_folders = files.roles, files.held_out, files.outside, bool(files.folders)
    seeded, to_int = (carve.seeded, int.from_bytes) if carve is not None else (None, None)
    for name in names:
        head, _, tail = name[cut:].partition("/")
        if split_folders:
            cls, _, image = tail.partition("/")
            role = SPLIT_FOLDERS.get(head.lower()) if image else None
        else:
            role, cls = ("train", head) if tail else (None, None)
        if role is None:
            outside.append(name)
            continue
        if role == "train" and carve is not None:  # Roles.__call__, inlined: this loop may see millions of names
            h = seeded.copy()
            h.update(name[cut:].encode())  # the path inside the data: an archive and its unpacked folder split alike
            u = to_int(h.digest(), "big")
            role = "val" if u < carve.val else "test" if u < carve.test else "train"
            if role != "train":
                held_out[role].append(name)
        roles[role].append((name, cls))
    return files


def first_folders(ordered: list[str], cut: int, deep: bool = False) -> list[str]:
    """The distinct first folders of sorted names from position `cut` on (with `deep`: of names at least two
    folders deep there), found by jumping over each folder's names (a bisection each, not a pass over all)."""
    found, i = [], 0
    while i < len(ordered):
        head, sep, _ = ordered[i][cut:].partition("/")
        if not sep:
            i += 1
            continue
        end = bisect.bisect_left(ordered, ordered[i][:cut] + head + "0", i + 1)  # head/... sorts before head0
        inner = cut + len(head) + 1
        if not deep or any("/" in n[inner:] for n in ordered[i:end]):
            found.append(head)
        i = end
    return found


@dataclass
class Inventory:
    """What the run's data.json records: the classes, each split's counts, the held-out files and the files
    skipped, with why."""

    classes: list[str]
    counts: dict[str, dict[str, int]]  # role -> class -> images (roles with none left out)
    held_out: dict[str, list[str]]
    skipped: list[dict[str, str]]
    images: dict[str, int] | None = None  # role -> images, where not the sum of the classes' (multi-label)

    def total(self, role: str) -> int:
        """The split's images (a multi-label image counts once, however many classes it shows, or none)."""
        return self.images[role] if self.images is not None else sum(self.counts[role].values())

    def to_json(self) -> dict:
        splits = {
            role: {"images": self.total(role), "per_class": {c: per.get(c, 0) for c in self.classes}}
            for role, per in self.counts.items()
        }
        return {"classes": self.classes, "splits": splits, "held_out": self.held_out, "skipped": self.skipped}

    @classmethod
    def from_json(cls, d: dict) -> Inventory:
        """What to_json wrote (a shard index keeps it)."""
        counts = {role: dict(s["per_class"]) for role, s in d["splits"].items()}
        images = {role: int(s["images"]) for role, s in d["splits"].items()}
        multilabel = any(images[role] != sum(counts[role].values()) for role in counts)
        return cls(list(d["classes"]), counts, dict(d["held_out"]), list(d["skipped"]), images if multilabel else None)

    def digest(self) -> str:
        """A fingerprint of the split (which files are held out, and each split's counts): a resumed run checks it."""
        what = {"classes": self.classes, "counts": self.counts, "held_out": self.held_out}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def lines(self) -> list[str]:
        """The counts for the start-up lines, with a warning when the classes are far apart in size."""
        out = []
        for role, per in self.counts.items():
            shown = ", ".join(f"{c} {per.get(c, 0)}" for c in self.classes[:8])
            more = f", ... ({len(self.classes)} classes)" if len(self.classes) > 8 else ""
            out.append(f"data: {role} {self.total(role)} images: {shown}{more}")
        train = self.counts.get("train", {})
        sizes = [train.get(c, 0) for c in self.classes]
        if sizes and min(sizes) * IMBALANCE <= max(sizes):
            small = min(self.classes, key=lambda c: train.get(c, 0))
            big = max(self.classes, key=lambda c: train.get(c, 0))
            out.append(
                f"warning: the classes are imbalanced: {big} has {train.get(big, 0)} training images, {small} "
                f"{train.get(small, 0)}; train.class_weights=balanced weighs the loss against it"
            )
        return out


def count(labels: list[int] | Counter, classes: list[str]) -> dict[str, int]:
    """Images per class name, from class indices (or their counts)."""
    tally = Counter(labels)
    return {c: tally.get(i, 0) for i, c in enumerate(classes)}


def across_classes(files: list[tuple[str, str]], limit: int) -> list[str]:
    """Up to `limit` of the (name, class) files, taken from every class in turn (in sorted order the first would be
    the first classes' alone)."""
    by_class: dict[str, list[str]] = {}
    for name, cls in files:
        by_class.setdefault(cls, []).append(name)
    turns = itertools.zip_longest(*by_class.values())
    return [name for turn in turns for name in turn if name is not None][:limit]


def split_of(rel: str) -> str | None:
    """The split a data file's name gives: its name's first word (train-00000-of-00004.*), else its folder's
    (<config>/train/0000.*); None when neither is a split's name."""
    folder, _, name = rel.rpartition("/")
    head = re.split(r"[-_.]", name.lower(), maxsplit=1)[0]
    word = head if head in SPLIT_FOLDERS else folder.rpartition("/")[2].lower()
    return SPLIT_FOLDERS.get(word)


def config_of(rel: str) -> str:
    """The folder of a file's configuration (the Hugging Face hub's <config>/train-*.*, or <config>/train/*.*)."""
    folder, _, _ = rel.rpartition("/")
    parent, _, last = folder.rpartition("/")
    return parent if last.lower() in SPLIT_FOLDERS else folder
