"""`python -m app` is the same as the `vramguard` command."""

from app.cli.main import main

if __name__ == "__main__":  # not when a decode worker process loads this module
    raise SystemExit(main())
