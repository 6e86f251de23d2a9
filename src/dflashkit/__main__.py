"""`python -m dflashkit ...` is the same as the `dflashkit` console script."""

from dflashkit.cli import main

raise SystemExit(main())
