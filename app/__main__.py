"""`python -m app` is the same as the `vramguard` command."""

from app.cli import main

raise SystemExit(main())
