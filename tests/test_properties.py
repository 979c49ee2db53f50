"""Hypothesis over shapes and options: every configuration matches torch.nn in float64."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_layers import compare, make_layer, run_pair

configs = st.fixed_dictionaries({
    "mode": st.sampled_from(["RNN", "GRU", "LSTM"]),
    "num_layers": st.integers(1, 3),
    "bidirectional": st.booleans(),
    "batch_first": st.booleans(),
    "bias": st.booleans(),
    "B": st.integers(1, 8),
    "T": st.integers(1, 12),
    "I": st.integers(1, 6),
    "H": st.integers(1, 9),
    "lengths": st.booleans(),
    "hx": st.booleans(),
    "seed": st.integers(0, 2**32 - 1),
})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_matches_torch_on_random_shapes(c):
    torch.manual_seed(c["seed"])  # torch initialises the shared weights: keep examples replayable
    ours, ref = make_layer(c["mode"], c["I"], c["H"], "float64", num_layers=c["num_layers"],
                           bidirectional=c["bidirectional"], batch_first=c["batch_first"],
                           bias=c["bias"])
    errs = run_pair(ours, ref, c["B"], c["T"], np.random.default_rng(c["seed"]),
                    lengths=c["lengths"], hx=c["hx"])
    compare(errs, "float64")


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(1, 10), st.integers(0, 2**32 - 1))
def test_outputs_past_lengths_are_zero_and_states_stop(B, T, seed):
    rng = np.random.default_rng(seed)
    ours, _ = make_layer("GRU", 2, 3, "float64", bidirectional=True)
    x = rng.standard_normal((T, B, 2))
    lens = rng.integers(1, T + 1, size=B)
    y, hn = ours.forward(x, lengths=lens)
    for b, n in enumerate(lens):
        assert not y[n:, b].any()
        alone, hn_alone = ours.forward(x[:n, b:b + 1])  # the sequence by itself, unpadded
        np.testing.assert_allclose(y[:n, b:b + 1], alone, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(hn[:, b:b + 1], hn_alone, rtol=1e-12, atol=1e-14)
