"""Whether this run is the full set (``PRNN_TEST_EVERY_KERNEL=1``): every kernel configuration,
cell, dtype and exchange path that CI samples (docs/design.md, "The suite's time (CI)")."""
from __future__ import annotations

import os

EVERY_KERNEL = os.environ.get("PRNN_TEST_EVERY_KERNEL", "") not in ("", "0")
