"""Instructions a decoding step executes on the host, counted by callgrind (issue 29).

    python bench/step_instructions.py [--out DIR] [--calls 200] [--cell LSTM|GRU] [--rows ...]

A decoding loop's steady state at B=1 (input and hidden size 8; each step given the state the
last one returned), as a GPU runs it eagerly, only its host Python counted - the stand-in of
``bench/call_instructions.py`` for a layer call, whose ``count`` runs each row here (a callgrind
process of its own, instructions counted only inside the ``functools.reduce`` that makes the
steps after their warm-up: deterministic on any load). Rows:

* ``decoder``: the layer API's resident decoder, ``cell.decoder(batch=1).step(x, state)``;
* ``fused``: the layer API's single-step call on the fused step kernel,
  ``Cell(algo="persistent").forward(x, state)``;
* ``torch-decoder``: ``persistent_rnn.torch``'s cell ``.decoder(batch=1).step(x, state)`` (CPU
  tensors: the hand-over is NumPy's, not CuPy's and DLPack's);
* ``torch-cell``: ``persistent_rnn.torch``'s cell with ``algo="persistent"`` (the fused step
  kernel) called under ``torch.no_grad``.

Stubbed as the layer call's stand-in stubs them, after a few real steps (kernels built, caches
filled): the emulated launches (``EmulatedModule._launch`` returns at once; a GPU launches the
kernel there); a resident decoder's launch ended and replaced by a stand-in a GPU's steady
state answers as - its query (a CuPy stream's ``done``: cudaStreamQuery) C's ``bool()``, not
ended, and its fault words not read after each step (the emulation's check; a GPU reads them at
``check()``). Per step, less the loop's own (the ``nothing`` row). The torch rows import torch
(minutes under valgrind). Writes ``DIR/step_instructions.json`` with ``--out``.
"""
from __future__ import annotations

import argparse
import functools
import sys
import types
from pathlib import Path
from typing import Callable

import numpy as np

from call_instructions import (count_rows, has_valgrind,  # (bench/: the script's folder)
                               write_record)

ROWS = ("decoder", "fused", "torch-decoder", "torch-cell")
SIZE, BATCH = 8, 1  # input and hidden size, batch
WARM_STEPS = 3  # real steps before the stubs


def _as_on_a_gpu(dec) -> None:
    """A resident decoder (``persistent_rnn.decoder.Decoder``) whose steps find its launch as a
    GPU's steady state does: the emulated launch ended, in its place one whose query is C's
    ``bool()`` (not ended: no relaunch) and whose fault words are not read each step."""
    resident = dec._layers.resident
    resident.stop()
    resident.closed, resident.running = False, types.SimpleNamespace(done=bool, join=bool)
    resident.fault = types.SimpleNamespace(any=bool)


def _looped(step: Callable, x) -> Callable[[], object]:
    """A decoding loop's step: ``step(x, state)``, the state the last call returned."""
    carried = [None]

    def call() -> object:
        carried[0] = step(x, carried[0])
        return carried[0]
    return call


def _stand_in(row: str, cell: str) -> Callable[[], object]:
    """The stand-in of ``row`` (its stubs set for the process)."""
    if row == "nothing":
        return lambda: None
    from persistent_rnn import emulate
    if row.startswith("torch"):
        import torch
        import persistent_rnn.torch as prt
        torch.manual_seed(0)
        torch.set_grad_enabled(False)
        module = getattr(prt, f"{cell}Cell")(SIZE, SIZE, algo="persistent")
        x = torch.randn(BATCH, SIZE)
        dec = module.decoder(batch=BATCH) if row == "torch-decoder" else None
        call = _looped(module if dec is None else dec.step, x)
        resident = None if dec is None else dec._dec
    else:
        import persistent_rnn as prnn
        module = getattr(prnn, f"{cell}Cell")(SIZE, SIZE, algo="persistent", seed=0)
        x = np.random.default_rng(0).standard_normal((BATCH, SIZE)).astype(np.float32)
        resident = module.decoder(batch=BATCH) if row == "decoder" else None
        call = _looped(module.forward if resident is None else resident.step, x)
    if resident is not None and not resident.resident:
        raise RuntimeError(f"{row}: the decoder is not resident ({resident.reason})")
    for _ in range(WARM_STEPS):
        call()
    emulate.EmulatedModule._launch = lambda self, *args, **named: None
    if resident is not None:
        _as_on_a_gpu(resident)
    return call


def child(row: str, calls: int, cell: str) -> None:
    """In the callgrind process: warm the row up, then make ``calls`` steps inside
    ``functools.reduce`` (the only region counted)."""
    call = _stand_in(row, cell)
    for _ in range(50):
        call()
    functools.reduce(lambda done, _: call(), range(calls), None)


def main(argv: list[str] | None = None) -> int:
    """Count every row in its own callgrind process; print a table, write the JSON."""
    p = argparse.ArgumentParser(prog="bench/step_instructions.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="output directory (created)")
    p.add_argument("--calls", type=int, default=200, help="steps counted per row")
    p.add_argument("--cell", default="LSTM", choices=("LSTM", "GRU"))
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        child(args.child, args.calls, args.cell)
        return 0
    if not has_valgrind("bench/step_instructions.py"):
        return 2
    loop, rows = count_rows(args.rows, args.calls, args.cell, "step", __file__)
    if args.out is not None:
        write_record(args.out / "step_instructions.json",
                     "CPU run: instructions counted by callgrind, the emulated launches and the "
                     "resident launch's query stubbed",
                     {"cell": args.cell, "input_size": SIZE, "hidden": SIZE, "batch": BATCH,
                      "calls": args.calls}, loop, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
