"""Where a run's records go: metrics.jsonl, TensorBoard, the console, MLflow, hypertune, Ray."""
