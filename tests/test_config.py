import fsspec
import pytest

from job.config import Config, load_config, to_yaml
from job.errors import ConfigError


def test_presets_load_and_iris_is_the_default():
    iris = load_config()
    assert iris.name == "iris" and iris.data.kind == "csv" and iris.data.batch_size == "full"
    assert iris.model.name == "mlp" and iris.model.hidden == [10] and iris.train.epochs == 20000
    cifar = load_config("cifar10")
    assert cifar.model.name == "cifar_cnn" and cifar.data.batch_size == 64 and cifar.optim.lr == 0.01


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        "cifar10",
        [
            "train.epochs=3",
            "optim.lr=1e-3",
            "data.random_hflip=true",
            "model.hidden=[32, 16]",
            "data.path=gs://bucket/cifar",
            "model.kwargs.depth=4",
        ],
    )
    assert cfg.train.epochs == 3 and cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.data.random_hflip is True and cfg.model.hidden == [32, 16]
    assert cfg.data.path == "gs://bucket/cifar" and cfg.model.kwargs == {"depth": 4}


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.no_such_key=3", "train.no_such_key: unknown key"),
        ("train.epoch=3", "did you mean train.epochs?"),
        ("nope.x=1", "nope: unknown key"),
        ("train.epochs=ten", "train.epochs: input should be a valid integer"),
        ("train.epochs=0", "train.epochs: input should be greater than 0"),
        ("optim.lr=fast", "optim.lr: input should be a valid number"),
        ("optim.lr=-1", "optim.lr: input should be greater than 0"),
        ("train.precision=fp8", "train.precision: input should be 'fp32', 'bf16', 'fp16' or 'auto'"),
        ("data.batch_size=-4", "data.batch_size: expected a positive integer or 'full'"),
        ("data.batch_size=half", "data.batch_size: expected a positive integer or 'full'"),
        ("model.name=transformer", "model.name: unknown model 'transformer'"),
        ("name=has space", "name: string should match pattern"),
        ("data.test_split=1.5", "data.test_split: input should be less than 1"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("iris", [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config("iris", ["train.epochs"])
    with pytest.raises(ConfigError, match="train.epochs is not a section"):
        load_config("iris", ["train.epochs.x=1"])


def test_yaml_from_any_url_and_round_trip():
    cfg = load_config("iris", ["train.epochs=7"])
    with fsspec.open("memory://configs/run.yaml", "w") as f:
        f.write(to_yaml(cfg))
    again = load_config("memory://configs/run.yaml")
    assert again == cfg


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file, and not a preset"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(str(listy))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("train:\n  epochs: 5\n  bogus: 1\ndata:\n  kind: excel\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(wrong))
    assert "train.bogus: unknown key" in str(e.value) and "data.kind:" in str(e.value)


def test_every_field_is_documented():
    def fields(model, prefix=""):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Config.__mro__[1]):
                yield from fields(annotation, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", field.description

    missing = [key for key, doc in fields(Config) if not doc]
    assert not missing


def test_the_config_knows_the_models_the_recipe_builds():
    from job.config.model import JOB_MODELS
    from job.recipe.models import MODELS

    assert set(JOB_MODELS) == set(MODELS)
    for name in (*JOB_MODELS, "resnet50", "pkg.mod:Net"):
        assert load_config("iris", [f"model.name={name}"]).model.name == name


@pytest.mark.parametrize(
    "weights, needle",
    [
        ("IMAGENET1K_V1", "model.weights: a torchvision weights name (IMAGENET1K_V1) needs a torchvision model"),
        ("ResNet18_Weights.IMAGENET1K_V1", "model.weights: the weights ResNet18_Weights.IMAGENET1K_V1 are not"),
        ("IMAGENET9K_V9", "model.weights: resnet50 has no weights IMAGENET9K_V9 (it has IMAGENET1K_V1"),
    ],
)
def test_torchvision_weights_are_checked_against_the_model(weights, needle):
    model = "mlp" if weights == "IMAGENET1K_V1" else "resnet50"
    with pytest.raises(ConfigError) as e:
        load_config("iris", [f"model.name={model}", f"model.weights={weights}"])
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert load_config("iris", ["model.name=resnet50", "model.weights=DEFAULT"]).model.weights == "DEFAULT"
