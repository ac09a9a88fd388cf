"""Faults a user can cause. Each is raised where it is found; cli.py turns it into one line and an exit code."""


class JobError(Exception):
    """A fault with a one-line explanation for the user."""


class ConfigError(JobError):
    """Bad command line or config."""


class DataError(JobError):
    """Data missing, unreadable or in an unexpected shape."""


class StorageError(JobError):
    """A storage location cannot be read or written, or credentials are missing."""


class CheckpointError(JobError):
    """A checkpoint is missing, corrupt, unsafe or does not fit the run."""


class Interrupted(JobError):
    """The run was stopped by a signal after committing a checkpoint (or before it had anything to save): the same
    command continues it."""


class Cancelled(JobError):
    """The user stopped the run (Ctrl-C) before it had anything to save."""


def one_line(e: BaseException) -> str:
    """An exception's message as one line, for wrapping library errors into the ones above."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
