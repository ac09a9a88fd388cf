"""A run: the loop, its commits and resume, its attempts, lease and cost."""
