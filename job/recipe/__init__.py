"""What a config means on a device: model, weights, step, schedule, precision, EMA, mixing, calibration.

build.py puts a recipe together from feed.py (the data where the run holds it, and its loaders), optimizer.py,
losses.py, schedule.py, ema.py and mix.py; plan.py decides how the step runs and at which precision; step.py is the
eager step, cuda_graph.py the same step replayed as CUDA graphs, accumulate.py gradient accumulation.
"""
