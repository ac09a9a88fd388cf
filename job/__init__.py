"""job: a PyTorch batch training job. Config in; TensorBoard logs, checkpoints and metrics out.

The package's parts, each a folder, top to bottom: a part imports only the parts below it (docs/architecture.md
draws them; the import-linter contracts in pyproject.toml, checked by `lint-imports` in CI, keep this map true):

    cli/         the command line: parse, call, turn faults into one line and an exit code; nothing imports it
    study/       many runs: a sweep's space, its Optuna storage, pruning, its results   } only the command line
    bench/       the tutorials' loop against the job's, for `job bench`                 } imports these two
    run/         one run: the loop, its evaluations and choice, checkpoints, resume, attempts, stop, cost
    use/         a trained model used: predict, evaluate, export, the model bundle, its diagnostics (run and use
                 may import each other: a run evaluates with use's test loop)
    recipe/      what a config means on a device: model, weights, step, schedule, precision, EMA, mixing
    sinks/       where a run's records go: one reporter, its sinks: metrics.jsonl, TensorBoard, the console, MLflow,
                 hypertune, Ray, Kubeflow Trainer's progress
                 (fed by a run: a sink never imports the run, a study or a use of a model)
    data/        the formats a data set comes in, read into memory or streamed as shards; the loaders
                 (never the recipe, the run, a sink, a use of a model or a study)
    config/      the typed config, one module per section; reads its YAML at any URL through storage
    group/       where a run runs: the platform (Slurm, Kubernetes, the clouds), launch, the process group,
                 signals, devices and seeds, memory
    storage/     any URL (cloud.py), run folders written locally and mirrored (run_folder.py, sync.py), their
                 lease; storage imports no other part
    errors.py, console.py, duration.py, recorded.py, retry.py
                 the base every part may use: the faults a user can cause, the console line, durations, the
                 scores an evaluation records, the one retry policy; it imports no part

Sweeps drive runs and sinks are fed by runs: no arrow back.
"""

__version__ = "0.1.0"
