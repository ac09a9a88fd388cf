import ast
import pickle
import tarfile
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import encode, pattern_images, tar_folder, write_cifar_batches, write_image_folder
from fsspec.implementations.memory import MemoryFileSystem

import job.data
from job.config import load_config
from job.data.read import load_data
from job.errors import DataError


def data_cfg(*overrides):
    return load_config("iris", list(overrides))


@pytest.fixture
def load(tmp_path):
    """load_data as the job calls it, with this test's own cache folder; the lines it logs are dropped."""
    return lambda cfg: load_data(cfg, tmp_path / "cache", lambda line: None)


# ---- CSV tables ----


def test_bundled_iris_split_and_scaling(load):
    d = load(data_cfg().data)
    assert (len(d.train), len(d.test)) == (120, 30)
    assert d.classes == ["setosa", "versicolor", "virginica"]
    assert d.train.x.shape == (120, 4) and d.train.x.dtype == torch.float32
    assert d.train.x.min() == 0 and d.train.x.max() == 1  # min-max fitted on the training split
    assert sorted(torch.bincount(torch.cat([d.train.y, d.test.y])).tolist()) == [50, 50, 50]
    same = load(data_cfg("seed=1").data)  # another run seed: other weights, the same held-out rows
    assert torch.equal(d.test.x, same.test.x) and torch.equal(d.train.x, same.train.x)
    other = load(data_cfg("data.split_seed=1").data)
    assert not torch.equal(d.test.x, other.test.x)


def test_the_held_out_rows_are_those_of_scikit_learns_split(load):
    # train_test_split(X, y, test_size=0.2, random_state=42), as the tutorials split Iris: the test rows are the first
    # ceil(0.2 n) of numpy's RandomState(42).permutation(n), the training rows the rest in that order.
    text = (resources.files("job.presets") / "iris.csv").read_text().splitlines()[1:]
    x = torch.tensor([[float(v) for v in line.split(",")[:4]] for line in text])
    order = np.random.RandomState(42).permutation(len(x))
    test, train = x[order[:30]], x[order[30:]]
    low, high = train.min(0).values, train.max(0).values
    d = load(data_cfg().data)
    assert torch.allclose(d.test.x, (test - low) / (high - low)) and torch.allclose(
        d.train.x, (train - low) / (high - low)
    )


def test_csv_with_separate_test_table_and_numeric_labels(tmp_path, load):
    (tmp_path / "train.csv").write_text("a,b,label\n0,10,2\n1,20,10\n2,30,2\n3,40,10\n")
    (tmp_path / "test.csv").write_text("a,b,label\n1.5,25,10\n")
    cfg = data_cfg(f"data.path={tmp_path}/train.csv", f"data.test_path={tmp_path}/test.csv", "data.target=label")
    d = load(cfg.data)
    assert d.classes == ["2", "10"]  # numeric order, not text order
    assert d.test.x.tolist() == [[0.5, 0.5]] and d.test.y.tolist() == [1]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("a,b,species\n1,2,x\n3,oops,y\n", "row 3, column 'b': not a number: 'oops'"),
        ("a,b\n1,2\n3,4\n", "no column 'species' for data.target"),
        ("a,species\n", "expected a header row and data rows"),
        ("a,b,species\n1,2,x\n3,y\n", "row 3: 2 fields, the header has 3"),
    ],
)
def test_csv_errors(tmp_path, text, needle, load):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=needle):
        load(data_cfg(f"data.path={path}").data)


def test_csv_missing_file(tmp_path, load):
    with pytest.raises(DataError, match="no such file"):
        load(data_cfg(f"data.path={tmp_path}/nope.csv").data)


# ---- CIFAR-10 python version ----


def cifar_cfg(path):
    return load_config("cifar10", [f"data.path={path}"]).data


def test_cifar_folder_archive_and_memory_are_one_reader(tmp_path, load):
    folder = write_cifar_batches(tmp_path / "cifar-10-batches-py", n_train=100, n_test=40)
    from_folder = load(cifar_cfg(folder))
    from_parent = load(cifar_cfg(tmp_path))
    archive = tar_folder(folder, tmp_path / "cifar-10-python.tar.gz", "cifar-10-batches-py")
    from_archive = load(cifar_cfg(archive))
    mem = MemoryFileSystem()
    mem.pipe_file("/cifar/cifar-10-python.tar.gz", archive.read_bytes())
    from_memory = load(cifar_cfg("memory://cifar/cifar-10-python.tar.gz"))
    assert from_folder.train.x.shape == (100, 3, 32, 32) and from_folder.test.x.shape == (40, 3, 32, 32)
    assert from_folder.classes[0] == "airplane" and len(from_folder.classes) == 10
    for other in (from_parent, from_archive, from_memory):
        assert torch.equal(other.train.x, from_folder.train.x) and torch.equal(other.test.y, from_folder.test.y)
    # pixels are laid out as CIFAR's R, G, B planes
    x, _ = pattern_images(10, 10, 32, 0)
    assert torch.equal(from_folder.train.x[:20], torch.from_numpy(x[:20]))


def test_cifar_refuses_pickles_that_build_other_objects(tmp_path, load):
    folder = write_cifar_batches(tmp_path / "cifar-10-batches-py")
    with open(folder / "data_batch_1", "wb") as f:
        pickle.dump(
            {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1], b"x": __import__("os").getcwd},
            f,
            protocol=2,
        )
    with pytest.raises(DataError, match="refused to load"):
        load(cifar_cfg(folder))


def test_cifar_errors(tmp_path, load):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no CIFAR-10 python-version batches"):
        load(cifar_cfg(empty))
    folder = write_cifar_batches(tmp_path / "cifar-10-batches-py")
    (folder / "test_batch").write_bytes(b"\x80\x02garbage")
    with pytest.raises(DataError, match="test_batch: not a readable CIFAR-10 batch"):
        load(cifar_cfg(folder))
    archive = tar_folder(write_cifar_batches(tmp_path / "b" / "cifar-10-batches-py"), tmp_path / "c.tar.gz", "c")
    truncated = tmp_path / "cut.tar.gz"
    truncated.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(DataError, match="not a readable tar archive"):
        load(cifar_cfg(truncated))


# ---- image folders ----


def folder_cfg(path, *extra):
    return load_config("cifar10", ["data.kind=folder", f"data.path={path}", *extra]).data


@pytest.mark.parametrize("fmt", ["png", "jpg"])
def test_image_folder_decodes_real_files(tmp_path, fmt, load):
    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=5, size=16, fmt=fmt)
    d = load(folder_cfg(root))
    assert d.classes == ["class0", "class1", "class2"]
    assert d.train.x.shape == (15, 3, 16, 16) and d.train.x.dtype == torch.uint8 and len(d.test) == 12
    x, _ = pattern_images(3, 5, 16, 0)
    err = (d.train.x.float() - torch.from_numpy(x).float()).abs().mean()
    assert err == 0 if fmt == "png" else err < 20  # PNG is lossless; JPEG loses detail in noise


def test_image_folder_as_archive_and_on_memory(tmp_path, load):
    root = write_image_folder(tmp_path / "imgs", per_class=4)
    direct = load(folder_cfg(root))
    archive = tar_folder(root, tmp_path / "imgs.tar.gz", "dataset")
    (tmp_path / "plain.tar").write_bytes(b"")
    with tarfile.open(tmp_path / "plain.tar", "w") as tar:
        tar.add(root, arcname="dataset")
    mem = MemoryFileSystem()
    for path in root.rglob("*.png"):
        mem.pipe_file(f"/imgs/{path.relative_to(root)}", path.read_bytes())
    for url in (archive, tmp_path / "plain.tar", "memory://imgs"):
        other = load(folder_cfg(url))
        assert torch.equal(other.train.x, direct.train.x) and torch.equal(other.test.y, direct.test.y)


def test_image_folder_sizes_resize_and_errors(tmp_path, load):
    root = write_image_folder(tmp_path / "imgs", per_class=3, size=16)
    img, _ = pattern_images(1, 1, 24, 5)
    (root / "train" / "class0" / "big.png").write_bytes(encode(img[0]))
    with pytest.raises(DataError, match="images differ in size.*set data.image_size"):
        load(folder_cfg(root))
    resized = load(folder_cfg(root, "data.image_size=8"))
    assert resized.train.x.shape[1:] == (3, 8, 8)
    (root / "train" / "class1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    skipped = load(folder_cfg(root, "data.image_size=8"))
    assert [s["path"] for s in skipped.inventory.skipped] == ["train/class1/broken.png"]
    assert len(skipped.train) == len(resized.train)
    with pytest.raises(DataError, match="cannot decode image train/class1/broken.png"):
        load(folder_cfg(root, "data.image_size=8", "data.skip_bad_samples=false"))
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    with pytest.raises(DataError, match="no images in the"):
        load(folder_cfg(empty))
    with pytest.raises(DataError, match="no such file or folder"):
        load(folder_cfg(tmp_path / "missing"))


def test_real_cifar_jpegs(real_cifar_subset, load):
    d = load(folder_cfg(real_cifar_subset))
    assert d.classes[:3] == ["airplane", "automobile", "bird"] and len(d.classes) == 10
    assert d.train.x.shape == (400, 3, 32, 32) and len(d.test) == 100
    assert 40 < d.train.x.float().mean() < 200  # real photographs, not blank decodes


# ---- the cache of remote data, and what the readers depend on ----


def test_remote_data_is_cached_in_the_given_folder_and_logged_to_the_callable(
    tmp_path, bucket, job_cache, capsys, load
):
    root = write_image_folder(tmp_path / "imgs", per_class=4)
    bucket.put_tree(root, "imgs")
    bucket.fs.pipe(f"{bucket.name}/iris.csv", (resources.files("job.presets") / "iris.csv").read_bytes())
    direct = load(folder_cfg(root))
    cache, lines = tmp_path / "given-cache", []
    images, table = bucket.url("imgs"), bucket.url("iris.csv")

    first = load_data(folder_cfg(images), cache, lines.append)
    assert torch.equal(first.train.x, direct.train.x) and torch.equal(first.test.y, direct.test.y)
    (tar,) = cache.glob("*/files.tar")  # one uncompressed tar of the folder's files, in the folder given
    fetched = next(line for line in lines if line.startswith("data: fetched"))
    assert fetched.startswith(f"data: fetched 24 files of {images} (") and fetched.endswith(" s, cached")
    again = load_data(folder_cfg(images), cache, lines.append)
    assert f"data: 24 files of {images} from the local cache ({tar.parent})" in lines
    assert torch.equal(again.train.x, first.train.x) and list(cache.glob("*/files.tar")) == [tar]

    load_data(data_cfg(f"data.path={table}").data, cache, lines.append)
    (csv,) = cache.glob("*/iris.csv")
    assert lines[-1].startswith(f"data: downloaded {table} (") and lines[-1].endswith(" s, cached")
    load_data(data_cfg(f"data.path={table}").data, cache, lines.append)
    assert lines[-1] == f"data: {table} from the local cache ({csv.parent})"
    cached = [line for line in lines if "cache" in line]
    assert len(cached) == 4
    for key in (tar.parent.name, csv.parent.name):  # not in $JOB_CACHE_DIR, where the job's own default is
        assert not (job_cache / "data" / key).exists()

    off = tmp_path / "cache-off"
    load_data(folder_cfg(images, "data.cache=false"), off, lines.append)
    assert not off.exists() and len([line for line in lines if "cache" in line]) == 4  # off: nothing kept or said
    assert capsys.readouterr() == ("", "")  # every line went to the callable, none to the console


def test_data_readers_do_not_import_the_run_storage_or_the_console():
    banned = {"job.storage.run_folder", "job.sinks"}
    for path in sorted(Path(job.data.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = ["job", "data"][: 3 - node.level] if node.level else []  # `from ..x` in job/data: job.x
                module = ".".join([*package, *([node.module] if node.module else [])])
                names = [module, *(f"{module}.{a.name}" for a in node.names)]
            else:
                continue
            hits = [n for n in names if any(n == b or n.startswith(b + ".") for b in banned)]
            assert not hits, f"{path.name}:{node.lineno} imports {hits[0]}"


def data_imports() -> dict[str, set[str]]:
    """Each module of job/data and the job/data modules it imports (at the top or inside a function)."""
    found = {}
    modules = {p.stem for p in Path(job.data.__file__).parent.glob("*.py")}
    for path in sorted(Path(job.data.__file__).parent.glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("job.data."):
                names.add(node.module.split(".")[2])
            elif isinstance(node, ast.ImportFrom) and node.module == "job.data":  # a module, or a name of __init__
                names.update(a.name if a.name in modules else "__init__" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name.split(".")[2] for a in node.names if a.name.startswith("job.data."))
        found[path.stem] = names
    return found


def test_the_data_package_is_layered_one_way_and_its_shard_reader_needs_no_torch():
    graph = data_imports()
    assert not graph["__init__"]  # the package's face names its modules; it imports none of them
    seen: dict[str, int] = {}

    def depth(module: str, path: tuple = ()) -> int:
        assert module not in path, f"job/data imports in a circle: {' -> '.join((*path, module))}"
        if module not in seen:
            seen[module] = 1 + max((depth(m, (*path, module)) for m in graph.get(module, ())), default=0)
        return seen[module]

    for module in graph:
        depth(module)
    for module in ("shards", "sample_stream", "files"):
        tree = ast.parse((Path(job.data.__file__).parent / f"{module}.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in imported if m.split(".")[0] in ("torch", "torchvision", "numpy")}, module


def test_an_empty_image_file_is_named_in_plain_words_and_the_layout_names_every_suffix_read(tmp_path):
    """A zero-byte photo's line says so (not Pillow's `<_io.BytesIO object at 0x...>`); a folder without the
    layout names every suffix the reader takes, not just .jpg and .png."""
    from conftest import invoke, sets

    root = write_image_folder(tmp_path / "imgs", n_classes=2, per_class=3, test_per_class=1)
    (root / "train" / "class0" / "empty.jpg").write_bytes(b"")
    strict = sets("data.kind=folder", f"data.path={root}", "data.skip_bad_samples=false", "data.image_size=32")
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", *strict])
    assert code == 3 and "empty.jpg" in err and "an empty file" in err and "BytesIO" not in err, err
    (tmp_path / "flat").mkdir()
    code, err = invoke(
        ["train", "--device", "cpu", "--config", "cifar10", *sets("data.kind=folder", f"data.path={tmp_path / 'flat'}")]
    )
    assert code == 3 and "*.jpg|jpeg|png|webp|heic|heif|avif|bmp|tif|tiff|gif layout" in err, err
