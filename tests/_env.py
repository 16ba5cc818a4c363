"""Facts about the run the tests adapt to."""

from __future__ import annotations

import os

#: set by CI; a server that cannot start fails the run there, and skips locally
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
