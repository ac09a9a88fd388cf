"""job: a PyTorch batch training job. Config in; TensorBoard logs, checkpoints and metrics out.

The way a run's data goes through the modules, top to bottom:

    config      job/config.py        the YAML preset or file, --set overrides, validated
    storage     job/cloud.py         fsspec filesystems and credentials for every URL (local, gs://, a Drive mount)
    data        job/data/            the data set read through fsspec (cached locally) into tensors in memory,
                                     and the loaders that cut and augment batches on the device; or shards
                                     streamed as the run trains (job/data/stream.py, packed by job/data/pack.py,
                                     decoded by job/data/decode.py on the host or the GPU)
    recipe      job/recipe.py        what the config means on a device: model (job/models.py), precision, optimizer,
                                     schedule and lookahead (job/schedule.py), loss, loaders
    loop        job/train.py         the run: epochs of steps (planned by job/plan.py, taken as job/step.py
                                     says), evaluations (job/evaluate.py scores a split, job/choose.py chooses),
                                     where it stands (job/progress.py), stops (job/stop.py)
    checkpoint  job/checkpoint.py    snapshots committed to the run folder; job/resume.py opens the folder and
                                     picks the checkpoint to continue from; job/lease.py holds it for one run
    report      job/report.py        metrics.jsonl, TensorBoard, curves and the console
    storage     job/storage.py       the run folder: written locally, mirrored to the store by job/sync.py

After training: job/bundle.py describes a model (model.json) and loads it; job/predict.py labels new inputs
(listed and read by job/inputs.py, split into parts by job/parts.py); job/export.py writes ONNX or torch.export.
The command line (job/cli.py) turns faults into one line and an exit code; job/distributed.py joins torchrun's
process group (started by job/launch.py), and job/memory.py names an out-of-memory in one line.
"""

__version__ = "0.1.0"
