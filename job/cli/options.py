"""The help of the options several commands share."""

CONFIG_HELP = (
    "Preset name (iris, cifar10, cifar10-fast, finetune, photos), or a YAML file at any URL (local, gs://, ...)."
)
SET_HELP = "Override a config key, e.g. --set train.epochs=5 (repeatable)."
