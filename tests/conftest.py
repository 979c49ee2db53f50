"""Shared test helpers: GPU detection for tests marked ``gpu`` and the ``settings`` fixture.

Tests marked ``@pytest.mark.gpu`` are skipped (with the reason) where CuPy is missing or no CUDA
device is visible; nothing else here touches CuPy, so CPU tests never depend on a GPU. Test
modules call ``gpu_available()`` (``from conftest import gpu_available``) or take the ``cupy``
fixture, which yields the module or skips.
"""
from __future__ import annotations

from functools import lru_cache

import pytest

import persistent_rnn as prnn


@lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    """``None`` if CuPy imports and sees at least one CUDA device, else why not."""
    try:
        import cupy
    except ImportError as exc:
        return f"cupy not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except RuntimeError as exc:  # CuPy's CUDARuntimeError: no driver / no device
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "no CUDA device (device count 0)"


def gpu_available() -> bool:
    """Whether GPU tests can run here."""
    return gpu_unavailable_reason() is None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not gpu_available():
        skip = pytest.mark.skip(reason=gpu_unavailable_reason())
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def cupy():
    """The ``cupy`` module on a machine with a GPU; skips the test elsewhere."""
    if not gpu_available():
        pytest.skip(gpu_unavailable_reason())
    import cupy as cp
    return cp


@pytest.fixture
def settings():
    """The runtime settings in force; ``prnn.configure`` calls in the test end with it."""
    with prnn.override_settings() as current:
        yield current


@pytest.fixture(autouse=True)
def _no_residency_cooldowns():
    """Every test starts and ends with no configuration cooling down after a grid found not
    co-resident (the runtime remembers them process-wide, ``runtime.COOLDOWNS``)."""
    from persistent_rnn import runtime
    runtime.COOLDOWNS.clear()
    yield
    runtime.COOLDOWNS.clear()


@pytest.fixture(autouse=True)
def _own_workspaces():
    """Every test ends by letting go of the chains and workspaces its calls reused
    (``buffers.release_workspaces``): a test that stubs launches leaves chains whose pass
    numbering ran ahead of the emulated device, whose records a later test of the same shapes
    would read as lost (the stall test of test_call_allocations after the multi-chain key test
    of test_call_plans, in one worker, did)."""
    yield
    from persistent_rnn import buffers
    buffers.release_workspaces()


@pytest.fixture
def fresh_plans():
    """For tests that patch the planner: the runtime's cache of plans and engines is emptied
    before and after (it is keyed by the layer's configuration, not by the planner's code)."""
    from persistent_rnn import runtime
    runtime._cached_engine.cache_clear()
    yield
    runtime._cached_engine.cache_clear()


@pytest.fixture
def stub_chains(monkeypatch):
    """``stub_chains(issue=None)`` replaces ``launch._issue_chain`` (a pass's whole chain: what a
    GPU replays as one graph launch) with ``issue`` (default: nothing runs) for the test. Stubbed
    chains number passes the device never ran, so their records would read as lost in later
    tests of the same shapes: every kept chain is let go after the test."""
    from persistent_rnn import buffers, launch

    def stub(issue=None) -> None:
        monkeypatch.setattr(launch, "_issue_chain", issue or (lambda *args: None))

    yield stub
    buffers.release_workspaces()


@pytest.fixture
def sixteen_bit_tiles_only(monkeypatch):
    """The planner without ``plan.widens``: 16-bit layers on their 16-bit tiles at every batch
    (what tests forcing the CUDA-core 16-bit tiles at small H, or comparing with them, need)."""
    from persistent_rnn import plan as planner
    monkeypatch.setattr(planner, "widens", lambda *args: False)


@pytest.fixture
def grid_path(monkeypatch):
    """The emulation planning for an H100 without thread-block clusters, so that layers run on the
    grid path (several CTAs exchanging through global memory) at any size: what tests of stalls of
    CTA 1, CTAs held back or forced grid tiles need. (The emulated H100 runs a small layer as one
    cluster, possibly of one CTA.)"""
    from campaign import emulated_profile
    from persistent_rnn import runtime
    monkeypatch.setattr(runtime, "EMULATED_DEVICE", emulated_profile("grid"))
