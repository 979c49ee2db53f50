"""Settings: checked values, environment variables, the scoped override, and ``inject_stall``
staying in the thread that entered it."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import settings as settings_module

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("changes, error, words", [
    ({"timeout_s": 1}, ValueError, "unknown setting 'timeout_s'"),
    ({"max_restarts": "3"}, TypeError, "max_restarts must be an int"),
    ({"max_restarts": 2.0}, TypeError, "max_restarts must be an int"),
    ({"max_restarts": True}, TypeError, "max_restarts must be an int"),
    ({"max_restarts": -1}, ValueError, "max_restarts must be >= 0"),
    ({"gpu_timeout_ms": -5}, ValueError, "gpu_timeout_ms must be > 0"),
    ({"gpu_timeout_ms": float("nan")}, ValueError, "gpu_timeout_ms must be > 0"),
    ({"emulation_timeout_ms": "2"}, TypeError, "emulation_timeout_ms must be a number"),
    ({"cooperative": "false"}, TypeError, "cooperative must be a bool"),
    ({"cooperative": 1}, TypeError, "cooperative must be a bool"),
    ({"auto_max_batch": -1}, ValueError, "auto_max_batch must be >= 0"),
    ({"emulation_max_resident": 0}, ValueError, "emulation_max_resident must be >= 1"),
    ({"residency_cooldown_s": -1}, ValueError, "residency_cooldown_s must be >= 0"),
    ({"residency_cooldown_s": float("inf")}, ValueError, "residency_cooldown_s must be >= 0"),
    ({"residency_cooldown_s": float("nan")}, ValueError, "residency_cooldown_s must be >= 0"),
    ({"residency_cooldown_s": "5"}, TypeError, "residency_cooldown_s must be a number"),
    ({"max_cluster_ctas": -1}, ValueError, "max_cluster_ctas must be >= 0"),
    ({"max_cluster_ctas": 8.0}, TypeError, "max_cluster_ctas must be an int or None"),
])
def test_configure_rejects_bad_names_types_and_ranges(settings, changes, error, words):
    before = prnn.configure()
    with pytest.raises(error, match=words):
        prnn.configure(**changes)
    with pytest.raises(error, match=words):
        with prnn.override_settings(**changes):
            pass
    assert prnn.configure() == before


def test_configure_accepts_and_converts(settings):
    s = prnn.configure(gpu_timeout_ms=50, max_restarts=np.int64(2), cooperative=np.bool_(True),
                       emulation_max_resident=None, residency_cooldown_s=0)
    assert (s.gpu_timeout_ms, s.max_restarts, s.cooperative) == (50.0, 2, True)
    assert s.residency_cooldown_s == 0.0 and type(s.residency_cooldown_s) is float
    assert type(s.max_restarts) is int and type(s.cooperative) is bool


def test_override_is_scoped_and_configure_inside_it_too():
    outside = prnn.configure()
    with prnn.override_settings(max_restarts=7) as inner:
        assert inner.max_restarts == 7 and prnn.configure().max_restarts == 7
        prnn.configure(gpu_timeout_ms=5)
        assert prnn.configure().gpu_timeout_ms == 5
    assert prnn.configure() == outside


def test_override_does_not_reach_other_threads():
    seen = []
    with prnn.override_settings(max_restarts=9):
        thread = threading.Thread(target=lambda: seen.append(prnn.configure().max_restarts))
        thread.start()
        thread.join()
    assert seen == [prnn.configure().max_restarts] and seen != [9]


@pytest.mark.parametrize("text, value", [("false", False), ("0", False), ("off", False),
                                         ("TRUE", True), ("1", True), ("yes", True), ("", False)])
def test_environment_booleans(text, value):
    assert settings_module.from_environment({"PRNN_COOPERATIVE": text}).cooperative is value


@pytest.mark.parametrize("env", [{"PRNN_TIMEOUT_MS": "abc"}, {"PRNN_TIMEOUT_MS": "-1"},
                                 {"PRNN_MAX_RESTARTS": "1.5"}, {"PRNN_COOPERATIVE": "maybe"},
                                 {"PRNN_AUTO_MAX_BATCH": "-3"},
                                 {"PRNN_EMULATION_MAX_RESIDENT": "0"}])
def test_environment_errors_name_the_variable(env):
    (name, _), = env.items()
    with pytest.raises(ValueError, match=name):
        settings_module.from_environment(env)


def test_environment_values_and_the_renamed_variable():
    s = settings_module.from_environment({"PRNN_TIMEOUT_MS": "25", "PRNN_MAX_RESTARTS": "5",
                                          "PRNN_EMULATION_MAX_RESIDENT": "2",
                                          "PRNN_RESIDENCY_COOLDOWN_S": "0.5",
                                          "PRNN_MAX_CLUSTER_CTAS": "8"})
    assert (s.gpu_timeout_ms, s.max_restarts, s.emulation_max_resident) == (25.0, 5, 2)
    assert s.residency_cooldown_s == 0.5 and s.max_cluster_ctas == 8
    with pytest.raises(ValueError, match="PRNN_MAX_RELAUNCHES was renamed to PRNN_MAX_RESTARTS"):
        settings_module.from_environment({"PRNN_MAX_RELAUNCHES": "2"})


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environ, timeout=120)


def test_environment_at_import_in_a_fresh_interpreter():
    ok = _python("import persistent_rnn as p; print(p.configure().cooperative)",
                 PRNN_COOPERATIVE="false")
    assert ok.returncode == 0 and ok.stdout.strip() == "False", ok.stderr
    # A malformed variable does not break the import; the first use names it.
    bad = _python("import persistent_rnn as p\nprint('imported')\np.configure()",
                  PRNN_TIMEOUT_MS="abc")
    assert bad.returncode != 0 and bad.stdout.strip() == "imported"
    assert "PRNN_TIMEOUT_MS='abc'" in bad.stderr.splitlines()[-1], bad.stderr


def test_overlapping_stalls_in_two_threads_leave_nothing_behind():
    # Thread A enters, B enters, A leaves, B leaves: with one global slot, A's exit restored
    # "no stall" under B and B's exit reinstalled A's stall for good.
    steps = [threading.Event() for _ in range(3)]
    seen = {}

    def a():
        with prnn.inject_stall(block=1, step=1, duration_ms=10):
            steps[0].set()
            steps[1].wait(10)
        seen["a_after"] = settings_module.current_stall()
        steps[2].set()

    def b():
        steps[0].wait(10)
        with prnn.inject_stall(block=2, step=2, duration_ms=20):
            steps[1].set()
            steps[2].wait(10)
            seen["b_inside"] = settings_module.current_stall()
        seen["b_after"] = settings_module.current_stall()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["b_inside"] == settings_module.Stall(2, 2, 20.0)
    assert seen["a_after"] == seen["b_after"] == settings_module.NO_STALL
    assert settings_module.current_stall() == settings_module.NO_STALL


@pytest.mark.parametrize("args, words", [((-1, 0, 1), "block"), ((0, True, 1), "step"),
                                         ((0, 0, 0), "duration_ms"),
                                         ((0, 0, float("inf")), "duration_ms"),
                                         ((0, 0, "5"), "duration_ms")])
def test_inject_stall_validates(args, words):
    with pytest.raises(ValueError, match=words):
        with prnn.inject_stall(*args):
            pass


def test_allow_tf32_is_off_by_default_and_reaches_the_planned_device(settings):
    from persistent_rnn import runtime
    assert settings_module.Settings().allow_tf32 is False
    assert settings_module.from_environment({"PRNN_ALLOW_TF32": "on"}).allow_tf32 is True
    assert runtime.planning_device(False).allow_tf32 is False
    with prnn.override_settings(allow_tf32=True):
        assert runtime.planning_device(False).allow_tf32 is True
    assert runtime.planning_device(False).allow_tf32 is False
