"""Benchmarks: the tutorials' loop against the job's own; never imported by a run."""
