"""Where a run runs: the platform, its processes, signals, devices and memory."""
