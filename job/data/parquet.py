"""data.kind parquet: a .parquet file, a folder of them, or the Hugging Face hub's layout (data/train-00000-of-00004
.parquet, <config>/<split>-*.parquet), at any URL, read with pyarrow over an fsspec file.

Images come from the hub's `Image` feature, a struct of bytes and path (the bytes; else the path, resolved beside the
parquet file as a manifest's is), or from a column of paths (data.path_column); labels from a `ClassLabel` column,
its names in the schema's `huggingface` metadata, or from data.label_column (class names, or indexes). Splits come
from the files' names (train, validation|val|valid, test); a split the files do not give is held out by the hash of
each row's key (job/data/split.py): its image path where the struct has one, else <file>:<row>. Rows are decoded as
an image folder's are (job/data/folder.py: one decoding, a bad image skipped and named), and a table of feature
columns with no image is read as a CSV table is (job/data/tabular.py, data.target its label).

Labels are read first (a column or two of each file), the images after, a row group at a time: a run packing the
rows into shards to stream them (job/data/pack.py) holds one row group's images at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from job.data.dataset import Dataset
from job.data.files import FETCH_CHUNK, Log, Read, Source, beside, fetch_named, held_or_fetched, local_file, source
from job.data.folder import check_files, held
from job.data.formats import Format
from job.data.items import Columns, Listed
from job.data.manifest import class_order
from job.data.preprocess import Preprocess
from job.data.split import Files, HoldOut, config_of, kind_of, label_names, split_of
from job.errors import ConfigError, DataError, StorageError, one_line
from job.storage.cloud import describe_storage_error

SUFFIX = ".parquet"
NEITHER = "an image struct with neither bytes nor path"


def is_parquet(url: str) -> bool:
    """A parquet file, or a folder of them (at any depth) holding no images: data.kind parquet."""
    if url.lower().endswith(SUFFIX):
        return True
    at = source(url, exists=False)
    fs, path = at.fs, at.path
    try:
        found = fs.find(path) if fs.isdir(path) else []
    except Exception:  # the stores' clients raise many types; the reader names the fault
        return False
    return any(p.lower().endswith(SUFFIX) for p in found) and not any(kind_of(p) == "image" for p in found)


def parquet_listed(src: Source) -> dict[str, dict]:
    """The parquet files of a file or folder: path -> info (what a pack of them is keyed by)."""
    fs, path = src.fs, src.path
    try:
        if fs.isfile(path):
            return {path: fs.info(path)}
        return {p: i for p, i in fs.find(path, detail=True).items() if p.lower().endswith(SUFFIX)}
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot list the data: {describe_storage_error(src.url, e)}") from None


def decoded_size(src: Source, held: int | None) -> int:
    """About how many bytes the rows' images take decoded at `held` x `held` (the rows counted from the files'
    footers); with no size held, the files' own size stands in, which only understates (images compress)."""
    fs, infos = src.fs, parquet_listed(src)
    if held is None:
        return sum(int(i.get("size") or 0) for i in infos.values())
    import pyarrow.parquet as pq

    rows = 0
    for p in infos:
        try:
            with fs.open(p, "rb") as f:
                rows += pq.ParquetFile(f).metadata.num_rows
        except Exception:  # a file that cannot be read is named when the rows are read
            return 0
    return rows * 3 * held * held


def read_error(url: str, e: Exception) -> Exception:
    """What a failed read of a parquet file is: a file pyarrow cannot read (cut short, not parquet), or the store's
    fault."""
    import pyarrow as pa

    if isinstance(e, pa.ArrowException):
        return DataError(f"{url}: not a readable parquet file (cut short or corrupt?): {one_line(e)}")
    return StorageError(f"cannot read {url}: {describe_storage_error(url, e)}")


def open_file(src: Source, named: str | None = None):
    """A parquet file as pyarrow reads it: a ParquetFile over an fsspec file object (local, cached, or remote);
    `named`: the URL its faults name (where `src` is its local copy)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(src.fs.open(src.path, "rb"))
    except Exception as e:  # pyarrow's errors and the stores'
        raise read_error(named or src.url, e) from None


def image_cells(f, image: str, url: str) -> Iterator[tuple[bytes | None, str | None]]:
    """Each row's image as the file holds it, in order, a row group at a time: (its bytes, its path); a column of
    paths has no bytes, and a struct's empty bytes are None."""
    import pyarrow as pa

    try:
        for batch in f.iter_batches(columns=[image]):
            column = batch.column(0)
            if not pa.types.is_struct(column.type):
                yield from ((None, p or None) for p in column.to_pylist())
                continue
            has_path = column.type.get_field_index("path") >= 0
            paths = column.field("path").to_pylist() if has_path else [None] * len(column)
            yield from ((b or None, p or None) for b, p in zip(column.field("bytes").to_pylist(), paths))
    except (DataError, StorageError):
        raise
    except Exception as e:  # pyarrow's errors and the stores'
        raise read_error(url, e) from None


def table_cells(table, features: dict) -> list[list[str]]:
    """A pyarrow table's rows, cells as text ('' for none), a ClassLabel column's index as its name."""
    header = table.column_names
    return [["" if r[h] is None else cell_text(features, h, r[h]) for h in header] for r in table.to_pylist()]


def cell_text(features: dict, column: str, value) -> str:
    """A table's cell as text; a ClassLabel column's index as its name."""
    spec = features.get(column)
    names = spec.get("names") if isinstance(spec, dict) and spec.get("_type") == "ClassLabel" else None
    if names and isinstance(value, int) and 0 <= value < len(names):
        return names[value]
    return str(value)


class ParquetData:
    """The rows of a parquet data set sorted into classes and splits (`files`: each row's key and class per split,
    `classes`), and, iterated, each row's (key, image bytes), a row group at a time; `missing()` after the pass
    names the rows whose image is not there (no bytes and no path, or a path to no file). `table` is true for a
    table of feature columns (no image column): tabular() reads it."""

    def __init__(self, src: Source, columns: Columns, hold: HoldOut, cache: Path | None, log: Log) -> None:
        self.url, self.log = src.url, log
        self.parts = self.listed(src)  # (the file, its name relative to `url`, split)
        self.opened = {rel: local_file(at, cache, log) for at, rel, _ in self.parts}
        self.first = self.open(self.parts[0][1]).schema_arrow
        self.features = huggingface_features(self.first)
        self.image, self.label, self.names, multilabel = pick_columns(self.url, self.first, self.features, columns)
        self.table = self.image is None
        self.files, self.classes = Files(multilabel=multilabel), list(self.names or [])
        self.row_keys: dict[str, list[str]] = {}  # file -> each row's key
        self.gone: list[dict[str, str]] = []
        if not self.table:
            self.sort_rows(hold)

    def listed(self, src: Source) -> list[tuple[Source, str, str | None]]:
        path = src.path
        found = sorted(parquet_listed(src))
        if not found:
            raise DataError(f"{self.url}: no .parquet files")
        root = path.rstrip("/") + "/"
        rels = [p[len(root) :] if p.startswith(root) else p.rpartition("/")[2] for p in found]
        splits = [split_of(rel) for rel in rels]
        configs = {config_of(rel) for rel in rels}
        if len(configs) > 1:
            shown = ", ".join(sorted(c or "." for c in configs)[:4])
            raise DataError(f"{self.url}: parquet files of several configurations ({shown}): name one folder")
        parts = [(src.within(p), rel, s) for p, rel, s in zip(found, rels, splits)]
        if any(s is not None for s in splits):
            other = [rel for _, rel, s in parts if s is None]
            if other:
                self.log(f"data: {len(other)} parquet files name no split (train, validation, test), e.g. {other[0]}: "
                         "ignored")  # fmt: skip
            return [(at, rel, s) for at, rel, s in parts if s is not None]
        return [(at, rel, "train") for at, rel, _ in parts]  # no split named: every row is train's, held out by hash

    def open(self, rel: str):
        """The file as pyarrow reads it (its local copy where it is cached)."""
        return open_file(self.opened[rel], self.where(rel))

    def where(self, rel: str) -> str:
        return next(at.url for at, r, _ in self.parts if r == rel)

    def read(self, rel: str, names: list[str]):
        """Columns (`image.path`: a struct's field) of a whole file, as a pyarrow table."""
        f = self.open(rel)
        if f.schema_arrow.names != self.first.names:
            raise DataError(f"{self.where(rel)}: columns {f.schema_arrow.names}, not those of {self.parts[0][1]}")
        try:
            return f.read(columns=names)
        except Exception as e:
            raise read_error(self.where(rel), e) from None

    def sort_rows(self, hold: HoldOut) -> None:
        """Each row's key, class and split (the labels and image paths of every file: no image bytes read)."""
        present = {s for _, _, s in self.parts}
        lacking = hold.lacking("val" not in present, "test" not in present)
        role_of = lacking.roles() if lacking is not None else None
        struct = self.image_is_struct()
        labels: list[str] = []  # every class name a row gives
        seen: set[str] = set()
        for at, rel, split in self.parts:
            wanted = [self.label, f"{self.image}.path" if struct else self.image]
            table = self.read(rel, wanted)
            paths = table.column(1).combine_chunks()
            paths = (paths.field("path") if struct else paths).to_pylist()
            keys = self.row_keys.setdefault(rel, [])
            for n, (value, path) in enumerate(zip(table.column(0).to_pylist(), paths)):
                label = self.label_of(value, at.url, n)
                key = path if path and path not in seen else f"{rel}:{n}"
                seen.add(key)
                role = split
                if role == "train" and role_of is not None:
                    role = role_of(key)
                    if role != "train":
                        self.files.held_out[role].append(key)
                self.files.roles[role].append((key, label))
                keys.append(key)
                labels.extend(label_names(label))
        if self.names is None:
            trained = {c for _, label in self.files.roles["train"] for c in label_names(label)}
            self.classes = class_order(labels, trained)

    def image_is_struct(self) -> bool:
        import pyarrow as pa

        return pa.types.is_struct(self.first.field(self.image).type)

    def label_of(self, value, at: str, n: int) -> str | tuple[str, ...]:
        """A row's class name: a ClassLabel's index (or name) checked against its names, or the value as text;
        multi-label (a list column): the tuple of its class names, sorted (empty: an image with none)."""
        if self.files.multilabel:
            if value is not None and not isinstance(value, list):
                raise DataError(f"{at} row {n}: column '{self.label}' holds {value!r}, not a list of labels")
            return tuple(sorted({self.label_of_one(v, at, n) for v in value or []}))
        if isinstance(value, list):
            raise DataError(f"{at} row {n}: column '{self.label}' holds a list: set data.task=multilabel")
        return self.label_of_one(value, at, n)

    def label_of_one(self, value, at: str, n: int) -> str:
        if value is None or value == "":
            raise DataError(f"{at} row {n}: no {self.label}")
        if self.names is None:
            return str(value).strip()
        if isinstance(value, int) and 0 <= value < len(self.names):
            return self.names[value]
        if isinstance(value, str) and value in self.names:
            return value
        shown = ", ".join(self.names[:5]) + (", ..." if len(self.names) > 5 else "")
        raise DataError(
            f"{at} row {n}: label {value!r} is not one of the {len(self.names)} ClassLabel names of column "
            f"'{self.label}' ({shown})"
        )

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        """(key, image bytes) of every row sorted, a row group at a time; images by path fetched a chunk at a time."""
        for at, rel, _ in self.parts:
            by_path: list[tuple[str, str]] = []
            for key, (data, path) in zip(self.row_keys[rel], image_cells(self.open(rel), self.image, at.url)):
                if data:
                    yield key, data
                elif path:
                    by_path.append((key, beside(at.url, path)))
                else:
                    self.gone.append({"path": key, "reason": NEITHER})
                if len(by_path) >= FETCH_CHUNK:
                    yield from self.fetched(by_path)
                    by_path = []
            yield from self.fetched(by_path)

    def fetched(self, by_path: list[tuple[str, str]]) -> Iterator[tuple[str, bytes]]:
        for (key, url), data in zip(by_path, fetch_named([url for _, url in by_path])):
            if isinstance(data, FileNotFoundError):
                self.gone.append({"path": key, "reason": f"no such file: {url}"})
            elif isinstance(data, Exception):
                raise StorageError(f"cannot read {url}: {describe_storage_error(url, data)}")
            else:
                yield key, data

    def missing(self) -> list[dict[str, str]]:
        return sorted(self.gone, key=lambda s: s["path"])

    def table_rows(self, split: str) -> tuple[list[str], list[list[str]]] | None:
        """A table's header and rows (cells as text, a ClassLabel's index as its name) of one split's files."""
        parts = [rel for _, rel, s in self.parts if s == split]
        if not parts:
            return None
        header = self.first.names
        return header, [row for rel in parts for row in table_cells(self.read(rel, header), self.features)]


def huggingface_features(schema) -> dict:
    """The `datasets` package's features of each column (from the schema's `huggingface` metadata), or {}."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return {}
    try:
        features = json.loads(meta).get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def image_column(url: str, schema, features: dict, path_column: str) -> str | None:
    """The image column: the hub's Image feature, else `path_column` (data.path_column), else a struct with bytes;
    None: a table of feature columns."""
    import pyarrow as pa

    names = schema.names
    images = [n for n in names if isinstance(f := features.get(n), dict) and f.get("_type") == "Image"]
    if not images:
        images = [n for n in names if n == path_column] or [
            n for n in names if pa.types.is_struct(t := schema.field(n).type) and t.get_field_index("bytes") >= 0
        ]
    if len(images) > 1:
        raise DataError(f"{url}: {len(images)} image columns ({', '.join(images)}): set data.path_column to one")
    return images[0] if images else None


def pick_columns(url: str, schema, features: dict, columns: Columns) -> tuple[str | None, str, list[str] | None, bool]:
    """The image column (None: a table of features), the label column, its ClassLabel names (None: plain), and
    whether it holds lists of labels (a Sequence of ClassLabel, or of names: multi-label)."""
    import pyarrow as pa

    names = schema.names
    typed = {n: f.get("_type") if isinstance(f, dict) else None for n, f in features.items()}
    image = image_column(url, schema, features, columns.path)
    if image is None:
        return None, columns.label, None, False  # a table of features: data.target names its label column, as a CSV's
    labelled = [n for n in names if typed.get(n) == "ClassLabel"]
    lists = [n for n in names if isinstance(features.get(n), (list, dict)) and typed.get(n) in ("Sequence", "List")]
    if columns.label in names:
        label = columns.label
    elif len(labelled) == 1:
        label = labelled[0]
    else:
        found = ", ".join(labelled) if labelled else "none"
        raise DataError(f"{url}: no column '{columns.label}' (columns: {', '.join(names)}; ClassLabel columns: "
                        f"{found}); set data.label_column")  # fmt: skip
    kind = schema.field(label).type
    listed = label in lists or pa.types.is_list(kind) or pa.types.is_large_list(kind)
    spec = features.get(label)
    if listed:  # Sequence(ClassLabel): {"_type": "Sequence", "feature": {"_type": "ClassLabel", "names": [...]}}
        inner = (
            spec.get("feature") if isinstance(spec, dict) else (spec[0] if isinstance(spec, list) and spec else None)
        )
        class_names = inner.get("names") if isinstance(inner, dict) and inner.get("_type") == "ClassLabel" else None
    else:
        class_names = spec.get("names") if isinstance(spec, dict) and typed.get(label) == "ClassLabel" else None
    return image, label, list(class_names) if class_names else None, listed


def load_parquet(
    cfg,
    cache: Path | None,
    log: Log,
    classes: list[str] | None = None,
    pre: Preprocess | None = None,
    src: Source | None = None,
) -> Dataset:
    """The parquet data set in memory, split; `classes`: a trained model's (its images are scored, not trained on:
    every row is read, none held out); `src`: cfg.path resolved, where the caller has."""
    url = cfg.path
    data = ParquetData(src or source(url), Columns.of(cfg), HoldOut.of(cfg), cache, log)
    if data.table:
        return tabular(cfg, data)
    scoring = classes is not None
    if not scoring:
        check_files(data.files, data.classes, url)
    elif unknown := sorted(
        {c for r in data.files.roles.values() for _, lb in r for c in label_names(lb)} - set(classes)
    ):
        raise DataError(f"{url}: labels the model does not know: {', '.join(unknown[:5])}")
    content = dict(data)
    skipped = data.missing()
    if skipped and not cfg.skip_bad_samples:
        raise DataError(f"{url}: {skipped[0]['path']}: {skipped[0]['reason']} (data.skip_bad_samples is false)")
    for role in data.files.roles:  # a row with no image is skipped and named, like one that cannot be decoded
        data.files.roles[role] = [(k, c) for k, c in data.files.roles[role] if k in content]
    classes = classes if scoring else data.classes
    return held(data.files, content.__getitem__, classes, cfg, url, f"parquet {url}", log, skipped, scoring, pre)


def tabular(cfg, data: ParquetData) -> Dataset:
    """A parquet table of feature columns, read as a CSV table is: its train files' rows, its test files' as the test
    table (else data.test_split of the rows); val files are not read (data.val_split holds val out)."""
    from job.data.tabular import table_dataset

    train = data.table_rows("train")
    if train is None:
        raise DataError(f"{data.url}: no train parquet files to learn from")
    if any(s == "val" for _, _, s in data.parts):
        data.log("data: a parquet table's validation files are not read; data.val_split holds val out of train")
    test = data.table_rows("test")
    return table_dataset(cfg, data.url, *train, (f"{data.url} (test)", *test) if test else None, "parquet")


def items(src: Source, hold: HoldOut, columns: Columns, log: Log) -> Listed:
    """The rows' images, a row group at a time, in the classes and splits their labels give (read first); a row with
    no image (no bytes, no path, a path to no file) is skipped and named."""
    rows = ParquetData(src, columns, hold, None, log)
    if rows.table:
        raise ConfigError(f"{src.url}: a table of feature columns (no image column) is read into memory, not packed")
    check_files(rows.files, rows.classes, src.url)
    return Listed(rows, rows.files, rows.classes)


def tables(url: str) -> Iterator[tuple[str, int, list[str], list[list[str]]]]:
    """Each file's rows (a file, or a folder of them), cells as text: rows named <file>#<row>, from 0."""
    at = source(url, exists=False)
    root = at.path.rstrip("/") + "/"
    for path in sorted(parquet_listed(at)):
        name = f"{url.rstrip('/')}/{path[len(root) :]}" if path.startswith(root) else url
        f = open_file(at.within(path), name)
        try:
            table = f.read()
        except Exception as e:  # pyarrow's errors and the stores'
            raise read_error(name, e) from None
        yield f"{name}#", 0, table.column_names, table_cells(table, huggingface_features(f.schema_arrow))


def rows(url: str, chunk: int) -> Iterator[list[Read]]:
    """Each row's image of a parquet file, `chunk` rows at a time, in order: named by its image's path where the row
    has one (read beside the file), else url#row; a row with no image says so."""
    f = open_file(source(url, exists=False))
    image = image_column(url, f.schema_arrow, huggingface_features(f.schema_arrow), "path")
    if image is None:
        raise DataError(f"{url}: no image column (a table of feature columns: a table's model predicts its rows)")
    cells = enumerate(image_cells(f, image, url))
    yield from held_or_fetched(((path or f"{url}#{n}", data, beside(url, path) if path and not data else None)
                                for n, (data, path) in cells), chunk, NEITHER)  # fmt: skip


FORMAT = Format(
    "parquet",
    lambda cfg, cache, log, src=None, started=None: load_parquet(cfg, cache, log, src=src),
    about="a .parquet file, a folder of them, or the Hugging Face hub's data/<split>-*.parquet layout",
    holds=is_parquet,
    items=items,
    listed=lambda src, columns: parquet_listed(src),
    decoded_size=decoded_size,
    columns=True,
    scored=lambda cfg, log, classes, pre: load_parquet(cfg, None, log, classes, pre),
    suffixes=(SUFFIX,),
    rows=rows,
    table=tables,
)
