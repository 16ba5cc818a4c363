"""``python -m ratequeue``: see :mod:`ratequeue.cli`."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
