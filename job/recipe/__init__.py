"""What a config means on a device: model, weights, step, schedule, precision, EMA, mixing, calibration."""
