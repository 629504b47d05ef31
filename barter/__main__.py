"""`python -m barter train ...`: the same as the `barter` command."""
from .training.cli import main

raise SystemExit(main())
