"""data.augment: torchvision.transforms.v2's TrivialAugment, RandAugment and RandomErasing, per image on the batch,
drawn from the run's seed."""

import pytest
import torch
from conftest import pattern_images
from torchvision.transforms import v2

from job.config import load_config
from job.data.augment import Policy, apply_policy, draw_policy, erasing_boxes, operation
from job.data.dataset import Split
from job.data.loader import BatchLoader
from job.errors import ConfigError

CPU = torch.device("cpu")


def same_device(t, device):
    return t.to(device)


def photos(n: int = 16, size: int = 24) -> torch.Tensor:
    return torch.from_numpy(pattern_images(4, n // 4, size)[0])


def torchvision_op(image: torch.Tensor, name: str, magnitude: float) -> torch.Tensor:
    ta = v2.TrivialAugmentWide(interpolation=v2.InterpolationMode.NEAREST)
    return ta._apply_image_or_video_transform(image, name, magnitude, interpolation=ta.interpolation, fill=ta._fill)


@pytest.mark.parametrize(
    ("name", "magnitude", "exact"),
    [
        ("Brightness", 0.6, True),
        ("Brightness", -0.4, True),
        ("Color", 0.7, True),
        ("Contrast", -0.5, True),
        ("Sharpness", 0.9, True),
        ("Posterize", 3.0, True),
        ("Solarize", 0.4, True),
        ("AutoContrast", 0.0, True),
        ("Equalize", 0.0, True),
        ("TranslateX", 5.0, True),
        ("TranslateY", -7.0, True),
        ("ShearX", 0.3, False),
        ("ShearY", -0.5, False),
        ("Rotate", 30.0, False),
    ],
)
def test_each_operation_is_torchvisions_at_each_images_magnitude(name, magnitude, exact):
    x = photos(4)
    # A batch of images at magnitudes of both signs: each is torchvision's own operation at its magnitude, or its
    # mirror image (the sign is drawn at random: which way a positive shear or rotation goes does not matter).
    unchanged = {"Posterize": 8.0, "Solarize": 1.0}.get(name, 0.0)  # the magnitude that changes nothing
    m = torch.tensor([magnitude, 0.5 * magnitude, magnitude, unchanged])
    out = operation(x, name, m)
    for i in range(4):
        want = torchvision_op(x[i], name, float(m[i]))
        if exact:
            assert (out[i].int() - want.int()).abs().max() <= 1, (name, i)  # rounding of a blend at most
        else:
            mirrored = torchvision_op(x[i], name, -float(m[i]))
            agree = max((out[i] == want).float().mean(), (out[i] == mirrored).float().mean())
            assert agree > 0.9, (name, i, float(agree))
    if name not in ("AutoContrast", "Equalize"):
        assert torch.equal(out[3], x[3])


def test_a_batch_applies_each_images_own_draws():
    x = photos(16)
    for policy in (Policy(trivial=True), Policy(rand=True)):
        drawn = draw_policy(policy, torch.Generator().manual_seed(0), 16, (24, 24))
        out = apply_policy(x, drawn, same_device)
        names = list(v2.TrivialAugmentWide._AUGMENTATION_SPACE)
        for i in range(16):
            alone = x[i : i + 1]
            for r in range(drawn.ops.shape[1]):
                alone = operation(alone, names[drawn.ops[i, r]], drawn.magnitudes[i, r : r + 1])
            assert torch.equal(out[i : i + 1], alone), i
        assert not torch.equal(out, x)
        assert len(set(drawn.ops[:, 0].tolist())) > 3  # images draw their own operations


def test_erasing_draws_torchvisions_boxes():
    boxes = erasing_boxes(torch.Generator().manual_seed(0), 4000, 32, 32, 0.25)
    erased = (boxes[:, 2] > boxes[:, 0]).float()
    assert 0.2 < erased.mean() < 0.3
    kept = boxes[erased.bool()]
    area = (kept[:, 2] - kept[:, 0]) * (kept[:, 3] - kept[:, 1]) / 1024
    assert area.min() >= 0.015 and area.max() <= 0.34
    assert kept[:, 2].max() <= 32 and kept[:, 3].max() <= 32 and kept.min() >= 0


def test_the_loader_draws_from_the_seed_and_resumes_the_same():
    split = Split(photos(16), torch.arange(16))
    policy = Policy(trivial=True, erasing=0.5)
    loader = BatchLoader(split, 4, CPU, CPU, seed=5, shuffle=True, hflip=True, policy=policy)
    full = list(loader.batches(epoch=1))
    rest = list(loader.batches(epoch=1, start=2))
    for a, b in zip(full[2:], rest):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    plain = list(BatchLoader(split, 4, CPU, CPU, seed=5, shuffle=True, hflip=True).batches(epoch=1))
    assert [b.y.tolist() for b in plain] == [b.y.tolist() for b in full]  # the same order and flips: drawn first
    assert any(not torch.equal(a.x, b.x) for a, b in zip(plain, full))
    assert any((b.x == 0).all(1).sum() > 4 for b in full)  # erased boxes: 0 in every channel
    other = list(BatchLoader(split, 4, CPU, CPU, seed=6, shuffle=True, hflip=True, policy=policy).batches(epoch=1))
    assert any(not torch.equal(a.x, b.x) for a, b in zip(other, full))


def test_bad_augment_settings_are_one_line():
    with pytest.raises(ConfigError, match="choose one"):
        load_config("iris", ["data.augment=[trivial_augment, rand_augment]"])
    with pytest.raises(ConfigError, match="data.augment"):
        load_config("iris", ["data.augment=[autoaugment]"])


def test_streamed_shards_are_augmented_from_the_seed(tmp_path):
    from conftest import invoke, write_image_folder

    from job.run.train import run

    src = write_image_folder(tmp_path / "images", size=32)
    code, err = invoke(["shard", str(src), str(tmp_path / "shards"), "--samples-per-shard", "8", "--val-split", "0"])
    assert code == 0, err
    base = [f"data.path={tmp_path / 'shards'}", "data.kind=shards", "data.placement=stream", "data.workers=0"]
    base += ["model.name=cifar_cnn", "train.epochs=1", "data.batch_size=12"]
    augmented = [*base, "data.augment=[rand_augment, random_erasing]", "data.erasing_probability=0.5"]
    out = {}
    for name, overrides in (("plain", base), ("a", augmented), ("b", augmented)):
        run(load_config("iris", overrides), str(tmp_path / name), "cpu", "never", True)
        out[name] = torch.load(tmp_path / name / "model.pt", weights_only=True)
    assert all(torch.equal(out["a"][k], out["b"][k]) for k in out["a"])
    assert any(not torch.equal(out["a"][k], out["plain"][k]) for k in out["a"])
