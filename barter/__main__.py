"""`python -m barter train ...`: the same as the `barter` command."""
from .cli import main

raise SystemExit(main())
