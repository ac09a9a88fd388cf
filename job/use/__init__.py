"""Using a trained model: predict, evaluate, export, the model bundle and its scores."""
