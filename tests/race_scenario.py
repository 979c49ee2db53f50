"""A GRU's forward (and backward) on the CPU emulation, checked against float64: what
tests/test_race_detector.py runs in a child process under the race detector
(``emulate.run_with_race_detector``), where a race fails the launch with ``RaceError``.

    python tests/race_scenario.py PATH:HIDDEN... [--forward-only] [--src DIR]

PATH: "grid" or "cluster" (campaign.emulated_profile); ``--src``: build persistent_forward from
that copy of cuda_src (a sabotaged one, tests/sabotage.py). Prints "ok PATH:HIDDEN" for each case
whose results match.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import persistent_rnn as prnn
from campaign import emulated_device
from persistent_rnn import emulate

STEPS, BATCH, INPUTS = 4, 2, 5


def _run(hidden: int, algo: str, dtype: str, backward: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((STEPS, BATCH, INPUTS))
    h0 = rng.standard_normal((1, BATCH, hidden))
    layer = prnn.GRU(INPUTS, hidden, dtype=dtype, algo=algo, seed=7)
    y, hn = layer.forward(x.astype(dtype), h0.astype(dtype), [STEPS, STEPS - 1])
    out = [y, hn]
    if backward:
        dy = rng.standard_normal((STEPS, BATCH, hidden)).astype(dtype)
        out += list(layer.backward(dy, np.zeros_like(hn)))
        out += [layer.grads[k].copy() for k in sorted(layer.grads)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("cases", nargs="+", help="PATH:HIDDEN, PATH grid or cluster")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--src", type=Path)
    args = parser.parse_args()
    if args.src is not None:
        build = emulate.get_module
        emulate.get_module = lambda source, defines: build(
            source, defines, args.src if source.startswith("persistent_forward") else None)
    backward = not args.forward_only
    for case in args.cases:
        path, hidden = case.split(":")
        with emulated_device(path), prnn.override_settings(emulation_timeout_ms=10_000):
            got = _run(int(hidden), "persistent", "float32", backward)
        ref = _run(int(hidden), "gemm", "float64", backward)
        for a, b in zip(got, ref):
            assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(b), 1e-30), f"{case} differs"
        print("ok", case, flush=True)


if __name__ == "__main__":
    main()
