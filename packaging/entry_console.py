"""Entry point of the bundled console executable: `vramguard serve|doctor|stop|...`."""

import multiprocessing

if __name__ == "__main__":
    # A decode worker process is this executable started again: freeze_support() runs the
    # worker and exits, before the command line (and everything it imports) is loaded.
    multiprocessing.freeze_support()
    from app.cli.main import main

    raise SystemExit(main())
