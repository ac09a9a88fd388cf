import sys
import textwrap

import pytest
import torch
from torch import nn

from job.config import load_config
from job.errors import ConfigError
from job.recipe.models import CifarCNN, build_model


def model_cfg(*overrides):
    return load_config("iris", list(overrides)).model


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_cifar_cnn_is_the_tutorials_network():
    model = build_model(model_cfg("model.name=cifar_cnn"), (3, 32, 32), 10)
    kinds = [type(m).__name__ for m in model]
    assert kinds == [
        "Conv2d",
        "MaxPool2d",
        "Conv2d",
        "MaxPool2d",
        "Conv2d",
        "MaxPool2d",
        "Flatten",
        "Linear",
        "Linear",
    ]
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (3, 32, (5, 5), (2, 2)),
        (32, 32, (5, 5), (2, 2)),
        (32, 64, (5, 5), (2, 2)),
    ]
    assert n_params(model) == 145_578
    assert isinstance(model, CifarCNN)


def test_mlp_iris_shape_and_flattening_for_images():
    iris = build_model(model_cfg(), (4,), 3)
    assert n_params(iris) == 4 * 10 + 10 + 10 * 3 + 3
    images = build_model(model_cfg("model.hidden=[16, 8]"), (3, 8, 8), 5)
    assert images(torch.zeros(2, 3, 8, 8)).shape == (2, 5)


def test_resnet18_small_stem_keeps_small_images_large():
    small = build_model(model_cfg("model.name=resnet18"), (3, 32, 32), 10)
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, nn.Identity)
    plain = build_model(model_cfg("model.name=resnet18", "model.small_stem=false"), (3, 32, 32), 10)
    assert plain.conv1.kernel_size == (7, 7)


def test_user_model_from_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent("""
        from torch import nn
        class Tiny(nn.Module):
            def __init__(self, num_classes, width=4):
                super().__init__()
                self.width = width
                self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(width), nn.ReLU(), nn.Linear(width, num_classes))
            def forward(self, x):
                return self.net(x)
        def not_a_module(num_classes):
            return 3
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model(model_cfg("model.name=mymodels:Tiny", "model.kwargs.width=7"), (4,), 3)
    assert model.width == 7 and model(torch.zeros(1, 4)).shape == (1, 3)
    with pytest.raises(ConfigError, match="cannot import no_such_pkg"):
        build_model(model_cfg("model.name=no_such_pkg.mod:Net"), (4,), 3)
    with pytest.raises(ConfigError, match="mymodels has no Missing"):
        build_model(model_cfg("model.name=mymodels:Missing"), (4,), 3)
    with pytest.raises(ConfigError, match="does not take"):
        build_model(model_cfg("model.name=mymodels:Tiny", "model.kwargs.depth=2"), (4,), 3)
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        build_model(model_cfg("model.name=mymodels:not_a_module"), (4,), 3)
    sys.modules.pop("mymodels", None)


def test_shape_mismatch_is_a_config_error_before_training():
    with pytest.raises(ConfigError, match=r"model cifar_cnn cannot take the data's inputs \(3x64x64\)"):
        build_model(model_cfg("model.name=cifar_cnn"), (3, 64, 64), 10)
