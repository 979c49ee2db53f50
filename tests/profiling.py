"""Running a call under Python's profiler hook (``sys.setprofile``), for tests that count what a
call runs (tests/test_call_cost.py, tests/test_call_plans.py)."""
from __future__ import annotations

import sys
from typing import Any, Callable


def run_profiled(call: Callable[[], object], hook: Callable[[Any, str, Any], None]) -> None:
    """``call()`` with ``hook(frame, event, arg)`` seeing every profiler event it causes."""
    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
