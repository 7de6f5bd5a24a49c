"""Entry point of the bundled windowed executable (the Start-menu shortcut).

With no arguments it runs the server and the tray icon. A windowed Windows program
has no stdout/stderr (they are None), so anything printed goes to the null device;
the log file keeps the record.
"""

import multiprocessing
import os
import sys

if __name__ == "__main__":
    # A decode worker process is this executable started again: freeze_support() runs the
    # worker and exits, before the command line (and everything it imports) is loaded.
    multiprocessing.freeze_support()
    from app.cli.main import windowed_main

    if sys.stdout is None or sys.stderr is None:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    raise SystemExit(windowed_main(sys.argv[1:]))
