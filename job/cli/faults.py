"""The one place a user's fault becomes one line on stderr and its exit code (each error class in errors.py carries
its own); a bug keeps its traceback."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import typer

from job.errors import JobError


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Faults the user can fix become one line on stderr and their exit code; bugs keep their traceback."""
    try:
        yield
    except JobError as e:
        code = e.exit_code
        prefix = "" if code in (75, 130) else "error: "
        if code not in (75, 130) or os.environ.get("RANK", "0") == "0":  # a group's stop is told once, by rank 0
            print(f"{prefix}{e}", file=sys.stderr)
        raise typer.Exit(code) from None
    except BrokenPipeError:  # the reader of standard output has left (`| head`): no fault, and nothing more to say
        quiet_stdout()
        raise typer.Exit(0) from None
    except KeyboardInterrupt:  # a second Ctrl-C while a run stops (job/group/stop.py), or one where nothing watches
        print("stopped at once by Ctrl-C; the last committed checkpoint, if any, is kept", file=sys.stderr)
        raise typer.Exit(130) from None


def quiet_stdout() -> None:
    """Standard output to /dev/null: its reader has gone, and a later write or flush would fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
