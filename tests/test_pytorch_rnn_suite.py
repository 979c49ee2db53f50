"""tests/pytorch_rnn_suite.py, the runner of PyTorch's own RNN tests, on a small test file of
ours written the way PyTorch's are (torch.nn.LSTM by name, module_db, a float64 case, a CUDA-only
skip, cell tests), in a subprocess: the counts it prints, and that the library ran."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from full_set import EVERY_KERNEL

RUNNER = Path(__file__).with_name("pytorch_rnn_suite.py")
ROOT = RUNNER.parent.parent

SAMPLE_TESTS = textwrap.dedent('''
    import unittest
    import torch
    import torch.nn as nn
    from torch.testing._internal.common_modules import module_db


    class TestRecurrent(unittest.TestCase):
        def test_lstm_by_name_runs_the_library(self):
            lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2)
            self.assertIsInstance(lstm, nn.LSTM)
            self.assertEqual(repr(lstm), "LSTM(3, 4, proj_size=2, num_layers=2, "
                                         "bidirectional=True)")
            out, (h, c) = lstm(torch.randn(5, 2, 3))
            out.sum().backward()
            self.assertEqual(lstm.last_run.algo, lstm.algo)
            self.assertEqual(tuple(out.shape), (5, 2, 4))

        def test_gru_float64(self):
            gru = nn.GRU(3, 4).double()
            gru(torch.randn(5, 2, 3, dtype=torch.float64))

        def test_rnn_from_module_db(self):
            info = next(i for i in module_db if i.module_cls is nn.RNN)
            rnn = info.module_cls(3, 4)
            self.assertIsInstance(rnn, nn.RNN)
            rnn(torch.randn(5, 2, 3))

        def test_rnn_save_load(self):
            import io
            buffer = io.BytesIO()
            torch.save(nn.RNN(3, 4), buffer)
            buffer.seek(0)
            loaded = torch.load(buffer)
            self.assertIsInstance(loaded, nn.RNN)
            loaded(torch.randn(5, 2, 3))

        @unittest.skipIf(True, "CUDA not available")
        def test_lstm_on_cuda(self):
            pass

        def test_rnn_cell(self):
            info = next(i for i in module_db if i.module_cls is nn.RNNCell)
            cell = info.module_cls(3, 4)
            self.assertIsInstance(cell, nn.RNNCell)
            cell(torch.randn(2, 3)).sum().backward()
            self.assertEqual(cell.last_run.algo, cell.algo)

        def test_lstm_cell_float64(self):
            nn.LSTMCell(3, 4).double()(torch.randn(2, 3, dtype=torch.float64))

        def test_lstm_failing(self):
            self.assertEqual(nn.LSTM(3, 4).hidden_size, 5)
''')


def run_suite(path: Path, algo: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, str(RUNNER), "--algo", algo, str(path), *extra],
                          capture_output=True, text=True, timeout=300, env=env, cwd=path.parent)


# CI runs the persistent road (the same runner code, float64 refused); the full set the gemm one too.
@pytest.mark.parametrize("algo", ["gemm", "persistent"] if EVERY_KERNEL else ["persistent"])
def test_runner_forces_the_library_and_counts(tmp_path, algo):
    path = tmp_path / "test_sample_recurrent.py"
    path.write_text(SAMPLE_TESTS)
    done = run_suite(path, algo)  # the default selection
    out = done.stdout
    assert done.returncode == 1, out + done.stderr  # the one deliberate failure
    refused = 2 * int(algo == "persistent")
    assert (f"algo={algo}: {6 - refused} passed, 1 failed, {refused} refused (float64 on the "
            f"persistent kernels); 1 skipped by torch, 0 selected but built no library "
            f"module") in out, out
    assert "test_lstm_failing: AssertionError: 4 != 5" in out
    assert "skipped by torch here: CUDA not available (1)" in out
    if algo == "persistent":
        assert "test_gru_float64: ValueError: algo='persistent' cannot run this layer: dtype " \
               "is float64" in out
        assert "test_lstm_cell_float64: ValueError: algo='persistent' cannot run this cell: " \
               "dtype is float64" in out
    # the cells alone
    done = run_suite(path, algo, "-k", "cell")
    refused //= 2
    assert f"algo={algo}: {2 - refused} passed, 0 failed, {refused} refused (float64 on the " \
           f"persistent kernels); 0 skipped by torch, 0 selected but built no library " \
           f"module" in done.stdout, done.stdout
