"""Entry point of the bundled console executable: `vramguard serve|doctor|stop|...`."""

import multiprocessing

from app.cli import main

if __name__ == "__main__":
    multiprocessing.freeze_support()
    raise SystemExit(main())
