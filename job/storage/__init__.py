"""Storage: any URL, run folders written locally and mirrored, committed safely."""
