"""`python -m job`: the command line, in a process of its own.

Once the command is done the process ends at once: after `import torch`, the interpreter's own teardown spends about
a second freeing objects (0.9 s of a 5 s Iris run measured on a 2-core CPU) that the operating system takes back at
exit anyway. Everything the command writes is closed by then; the exit handlers run, the decoding processes are
stopped and the streams flushed first. An error that escapes the command (a bug) ends the usual way, with its
traceback. A Ctrl-C before the command watches for signals ends the process at once, in one line (exit 130).
"""

import os
import signal
import sys


def _starting(sig, frame) -> None:
    """Ctrl-C before a command watches for it (importing torch takes seconds): nothing is done yet, and an import
    cut in the middle would fail again in the exit handlers; end now, in one line."""
    sys.stderr.write("stopped by Ctrl-C; nothing was done\n")
    sys.stderr.flush()
    os._exit(130)


signal.signal(signal.SIGINT, _starting)

from job.cli import end_process, main  # noqa: E402  # after the handler: imports are most of the start-up

try:
    main()
    code = 0
except SystemExit as e:
    if e.code is not None and not isinstance(e.code, int):
        raise
    code = e.code or 0
end_process(code)
