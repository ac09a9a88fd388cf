"""`python -m job`: the command line."""

from job.cli import main

main()
