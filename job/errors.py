"""Faults a user can cause. Each is raised where it is found; job/cli/ turns it into one line and its exit code
(run.json records the code too)."""


class JobError(Exception):
    """A fault with a one-line explanation for the user."""

    exit_code = 1


class ConfigError(JobError):
    """Bad command line or config."""

    exit_code = 2


class MetricNotWritten(ConfigError):
    """A run is asked to choose on a score its evaluations never write for its data (found once the data is read): a
    sweep on that metric can choose no trial, whatever their parameters."""


class DataError(JobError):
    """Data missing, unreadable or in an unexpected shape."""

    exit_code = 3


class StorageError(JobError):
    """A storage location cannot be read or written, or credentials are missing; or a run folder is being written by
    another run (lease.py): a place this run cannot write now, though the command is right."""

    exit_code = 4


class CheckpointError(JobError):
    """A checkpoint is missing, corrupt, unsafe or does not fit the run."""

    exit_code = 5


class Interrupted(JobError):
    """The run was stopped by a signal after committing a checkpoint (or before it had anything to save): the same
    command continues it."""

    exit_code = 75


class Cancelled(JobError):
    """The user stopped the run (Ctrl-C) before it had anything to save."""

    exit_code = 130


def one_line(e: BaseException) -> str:
    """An exception's message as one line, for wrapping library errors into the ones above."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def exit_code(e: BaseException) -> int:
    """The exit code a run ends with when `e` stops it: the error's own, 130 for a second Ctrl-C, 1 for a bug."""
    if isinstance(e, JobError):
        return e.exit_code
    return 130 if isinstance(e, KeyboardInterrupt) else 1
