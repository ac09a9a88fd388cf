"""The command line: parse, call, and turn the user's faults into one line and their exit code (each error class
in errors.py carries its own). Exit codes: 0 done, 1 a bug, 2 command line or config, 3 data, 4 storage or credentials
(or the run folder being written by another run), 5 checkpoint unusable, 75 interrupted with a checkpoint committed
(run the same command again), 130 stopped by the user (Ctrl-C) with nothing to continue.

The commands, in the order --help lists them, each in a module named for what it calls: run.py (train, sweep,
find-batch-size), model.py (evaluate, predict, export), track.py, machine.py (info, bench), shard.py.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import typer

from job.cli import machine, model, run, shard, track
from job.cli.faults import quiet_stdout

__all__ = ["app", "end_process", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="A PyTorch batch training job: config in; TensorBoard logs, checkpoints and metrics out.",
)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(run.train)
app.command()(run.sweep)
app.command()(model.evaluate)
app.command()(model.predict)
app.command()(model.export)
app.command()(track.track)
app.command()(machine.info)
app.command()(machine.bench)
app.command()(shard.shard)
app.command("find-batch-size")(run.find_batch_size)


def main() -> None:
    """Run the command line; a usage error (unknown option, missing value) is one line and exit 2 as well."""
    try:
        code = app(prog_name="python -m job", standalone_mode=False)
    except Exception as e:
        # typer raises its command-line errors as exceptions carrying their exit code; anything else is a bug.
        if not (hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int)):
            raise
        if e.format_message():  # empty after the help that a bare `python -m job` prints
            print(f"error: {e.format_message()} (see python -m job --help)", file=sys.stderr)
        code = e.exit_code
    from job.group.launch import is_worker

    if is_worker():  # a worker of a group, its files written and its group left
        # Past this point only the interpreter's teardown remains, where the group's transport threads can abort a
        # process that has finished ("terminate called without an active exception": exit -6 in place of 75).
        end_process(code or 0, exit_handlers=False)
    sys.exit(code or 0)


def end_process(code: int, exit_handlers: bool = True) -> NoReturn:
    """End this process now, without the interpreter's teardown, having done what of it matters: stop the decoding
    processes (they hold this one's stderr), run the exit handlers (unless told not to), flush the streams."""
    import atexit

    if decoders := sys.modules.get("job.data.decode"):
        decoders.close_pools()
    if exit_handlers:
        atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader has left: what it did not read is not wanted
        quiet_stdout()
    sys.stderr.flush()
    os._exit(code)
