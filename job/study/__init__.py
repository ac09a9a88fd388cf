"""Many runs: a sweep, its space, its study storage and its results."""
