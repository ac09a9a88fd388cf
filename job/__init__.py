"""job: a PyTorch batch training job. Config in; TensorBoard logs, checkpoints and metrics out.

The package's parts, each a folder (docs/architecture.md draws them, and the import rules in pyproject.toml,
checked by `lint-imports`, keep this map true):

    config.py, errors.py, console.py, duration.py, recorded.py
                 the base every part may use: the config, the faults a user can cause, the console line
    cli.py       the command line: parse, call, turn faults into one line and an exit code
    storage/     any URL (cloud.py), run folders written locally and mirrored (run_folder.py, sync.py)
    data/        the formats a data set comes in, read into memory or streamed as shards; the loaders
    recipe/      what a config means on a device: model, weights, step, schedule, precision, EMA, mixing
    run/         one run: the loop, its evaluations and choice, checkpoints, resume, attempts, lease, cost
    sinks/       where a run's records go: metrics.jsonl, TensorBoard, the console, MLflow, hypertune, Ray
    group/       where a run runs: the platform, its processes (launch, distributed), signals, memory
    use/         a trained model used: predict, evaluate, export, the model bundle, its diagnostics
    study/       many runs: a sweep's space, its Optuna storage, pruning, its results
    bench/       the tutorials' loop against the job's, for `job bench`; never imported by a run
"""

__version__ = "0.1.0"
