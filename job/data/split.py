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

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

# What the readers take for an image, by suffix in any case; every other file is counted as not an image.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".heic", ".heif", ".avif", ".bmp", ".tif", ".tiff", ".gif")
SUFFIXES = "|".join(s.lstrip(".") for s in IMAGE_SUFFIXES)  # as messages name them: jpg|jpeg|png|...
SYSTEM_FILES = {".ds_store", "thumbs.db", "desktop.ini", "ehthumbs.db", "icon\r"}
SYSTEM_FOLDERS = {"@eadir", "__macosx", "$recycle.bin", "system volume information"}
SPLIT_FOLDERS = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "test"}
ROLES = ("train", "val", "test")
IMBALANCE = 10  # a warning when the largest class has this many times the smallest's images


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def is_system_file(name: str) -> bool:
    """Files an operating system or a NAS leaves beside photos: hidden files (.DS_Store, macOS's ._ twins),
    Thumbs.db, desktop.ini, and anything in @eaDir/ or __MACOSX/."""
    parts = name.replace("\\", "/").split("/")
    if parts[-1].lower() in SYSTEM_FILES:
        return True
    return any(p.startswith(".") or p.lower() in SYSTEM_FOLDERS for p in parts if p)


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


def share(key: str, seed: int) -> float:
    """A number in [0, 1) that is a function of the key and the seed alone, uniform over keys."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def held_out_role(key: str, seed: int, val: float, test: float) -> str:
    """train, val or test for a sample with no split of its own."""
    u = share(key, seed)
    return "val" if u < val else "test" if u < val + test else "train"


@dataclass
class Files:
    """Image files sorted into roles: (relative name, class) per role; what was passed over, counted."""

    roles: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: {r: [] for r in ROLES})
    held_out: dict[str, list[str]] = field(default_factory=lambda: {"val": [], "test": []})
    outside: list[str] = field(default_factory=list)  # images in no class folder
    folders: tuple[str, ...] = ()  # the split folders the data has (empty: class folders at the top)

    def classes(self) -> list[str]:
        """The classes, sorted: those with training images (a split folder layout), or all (class folders)."""
        if self.folders:
            return sorted({c for _, c in self.roles["train"]})
        return sorted({c for role in ROLES for _, c in self.roles[role]})


def sort_files(names: list[str], hold: HoldOut) -> Files:
    """Image names (relative to the data folder or archive) sorted into classes and roles; see the module's doc."""
    split = [n.replace("\\", "/").split("/") for n in names]
    depth = 0  # an archive of one top folder: read from inside it
    while (
        split
        and all(len(p) >= depth + 3 for p in split)
        and len({p[depth] for p in split}) == 1
        and split[0][depth].lower() not in SPLIT_FOLDERS
    ):
        depth += 1
    files = Files()
    folders = {p[depth].lower() for p in split if len(p) > depth + 2 and p[depth].lower() in SPLIT_FOLDERS}
    files.folders = tuple(r for r in ROLES if r in {SPLIT_FOLDERS[f] for f in folders})
    carve_val = hold.val if "val" not in files.folders else 0.0
    carve_test = hold.test if "test" not in files.folders else 0.0
    for name, parts in zip(names, split):
        rest = parts[depth:]
        if files.folders:
            role = SPLIT_FOLDERS.get(rest[0].lower()) if len(rest) >= 3 else None
            cls = rest[1] if role else None
        else:
            role, cls = ("train", rest[0]) if len(rest) >= 2 else (None, None)
        if role is None:
            files.outside.append(name)
            continue
        if role == "train" and (carve_val or carve_test):
            role = held_out_role(name, hold.seed, carve_val, carve_test)
            if role != "train":
                files.held_out[role].append(name)
        files.roles[role].append((name, cls))
    return files


@dataclass
class Inventory:
    """What the run's data.json records: the classes, each split's counts, the held-out files and the files
    skipped, with why."""

    classes: list[str]
    counts: dict[str, dict[str, int]]  # role -> class -> images (roles with none left out)
    held_out: dict[str, list[str]]
    skipped: list[dict[str, str]]

    def to_json(self) -> dict:
        splits = {
            role: {"images": sum(per.values()), "per_class": {c: per.get(c, 0) for c in self.classes}}
            for role, per in self.counts.items()
        }
        return {"classes": self.classes, "splits": splits, "held_out": self.held_out, "skipped": self.skipped}

    @classmethod
    def from_json(cls, d: dict) -> Inventory:
        """What to_json wrote (a shard index keeps it)."""
        counts = {role: dict(s["per_class"]) for role, s in d["splits"].items()}
        return cls(list(d["classes"]), counts, dict(d["held_out"]), list(d["skipped"]))

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
            out.append(f"data: {role} {sum(per.values())} images: {shown}{more}")
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


def count(labels: list[int], classes: list[str]) -> dict[str, int]:
    tally = Counter(labels)
    return {c: tally.get(i, 0) for i, c in enumerate(classes)}
