"""The run's config: typed sections with a doc per field, YAML from a preset or any URL, `--set` overrides.

Validation errors name the key path and what was expected, in one line, before any work is done. One module per
section (data.py, model.py, optim.py, train.py with budget.py, output.py for output and track) and load.py for the
whole: reading, overrides, validation, the list of keys. Its one import of a part: storage, to read a YAML file at
any URL.
"""

from job.config.budget import Budget, parse_budget
from job.config.data import DataConfig
from job.config.load import (
    PRESET_LIST,
    PRESETS,
    Config,
    apply_override,
    check_setting,
    describe_error,
    flat_items,
    load_config,
    names_setting,
    read_yaml,
    setting_keys,
    to_yaml,
    validate,
)
from job.config.model import USER_MODEL_HINT, ModelConfig
from job.config.optim import OptimConfig, parse_warmup
from job.config.output import OutputConfig, TrackConfig, tracking_uri
from job.config.section import Section
from job.config.train import CHOOSABLE, TrainConfig

__all__ = [
    "CHOOSABLE",
    "PRESETS",
    "PRESET_LIST",
    "USER_MODEL_HINT",
    "Budget",
    "Config",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "OutputConfig",
    "Section",
    "TrackConfig",
    "TrainConfig",
    "apply_override",
    "check_setting",
    "describe_error",
    "flat_items",
    "load_config",
    "names_setting",
    "parse_budget",
    "parse_warmup",
    "read_yaml",
    "setting_keys",
    "to_yaml",
    "tracking_uri",
    "validate",
]
