"""Where a run's records go: one reporter (report.py) hands each record to its sinks (sink.py): metrics.jsonl,
TensorBoard, the console, MLflow, Vertex AI's hypertune file, Ray Train, Kubeflow Trainer's TrainJob progress."""
