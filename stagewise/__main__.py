"""Entry point for ``python -m stagewise``."""

from stagewise.cli import main

raise SystemExit(main())
