"""Where a torch module's forward spends its host time: each layer of the call timed alone.

    python bench/call_breakdown.py [--out DIR] [--calls 100] [--rounds 30] [--hidden 8]
                                   [--stubbed] [--dtype float32|float16|bfloat16]
                                   [--layers N] [--bidirectional] [--no-stack] [--cell GRU|LSTM]

``persistent_rnn.torch.GRU(algo="gemm")`` forward under ``torch.no_grad`` (H=I, B=1, T=1),
entered at each layer of its road, outermost first, beside ``torch.nn.GRU`` and the layer API:
the difference between two neighbouring rows is what that layer adds. Rows interleave in runs
of ``--calls`` calls (alternating their order), timed with ``time.perf_counter_ns``; median and
10th percentile in µs. Internal entry points (``ops._library_forward`` and the like) are called
with what the layer above would pass them. Writes ``DIR/call_breakdown.json`` with ``--out``.

``--stubbed`` adds eight rows: the layer API's persistent forward and forward + backward on the
emulated path (1) with the emulated launcher stubbed (``EmulatedModule._launch`` returns at
once: no kernel runs, every other line of the call does, the chain issued launch by launch with
each launch's arguments built), (2) with the whole chain stubbed (``launch._issue_chain``,
what a GPU call in steady state replaces by one graph launch; the graph's key, built on the GPU
path only, is not in it), (3) as a replay in steady state runs it on a GPU: the chain graph's
key built over the call's arrays (``id`` standing in for device pointers: ``value``,
``addresses``) and hashed as its look-up hashes it, the replay itself stubbed
(``chain_graphs.run``); and (4) ``persistent_rnn.torch.GRU(algo="persistent")`` on CPU tensors
(the emulated path) as (2): the forward under ``torch.no_grad``, forward + backward through
autograd (``y.sum().backward()``). (3) is the Python the latency
model's per-call host term takes (``hardware.PYTHON_*_US``), (1) bounds it from above; (4) is
what the torch road adds. ``--dtype``: the stubbed rows' layer and module in that dtype (a
16-bit layer's planned call: ``call_plans.HalfPlan``, its conversions inside the chain).
``--layers``, ``--bidirectional``: the stubbed rows' layer and module a stack, bidirectional
(planned: ``stack_plans`` in stack mode and as pairs, ``layer_plans`` with ``--no-stack``, the
``stack`` setting off: one layer-direction per launch) - what the latency model's per-call
Python of a multi-chain call takes (``hardware.PYTHON_GROUP_US``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import persistent_rnn as prnn
import persistent_rnn.torch as prt
from persistent_rnn import benchmark, chain_graphs, emulate, functional, launch
from persistent_rnn.torch import modules, ops, paths

from call_overhead import time_roads  # (bench/ is the script's folder)


def entry_points(hidden: int) -> dict[str, Callable[[], object]]:
    """The calls, outermost first (each one layer further in than the row before)."""
    torch.manual_seed(0)
    reference = torch.nn.GRU(hidden, hidden)
    module = prt.GRU(hidden, hidden, algo="gemm")
    module.load_state_dict(reference.state_dict())
    x = torch.randn(1, 1, hidden)
    weights = modules._current_weights(module)
    cell = ops._cell("GRU")
    decision = paths.choose("gemm", cell, x, hidden, 0, lambda: 1)
    params, x_array = ops._params(weights, 1, False), x.numpy()
    layer = prnn.GRU(hidden, hidden, algo="gemm")
    layer.load_params({k: v.detach().numpy() for k, v in reference.state_dict().items()})
    run = dict(num_layers=1, bidirectional=False, batch_first=False, algo="gemm")
    return {
        "torch.nn.GRU": lambda: reference(x),
        "module(x)": lambda: module(x),
        "module.forward": lambda: module.forward(x),
        "module._library_forward": lambda: module._library_forward(x, None, "gemm", decision),
        "ops.run_recurrence": lambda: ops.run_recurrence(x, None, None, None, weights, "GRU", 1,
                                                         False, "gemm", (0, 0, 1)),
        "ops._library_forward": lambda: ops._library_forward(x, None, None, None, weights,
                                                             "GRU", 1, False, "gemm", 0, 0),
        "functional.forward, tensors converted": lambda: functional.forward(
            cell, ops._params(weights, 1, False), ops._array(x), **run),
        "functional.forward, arrays given": lambda: functional.forward(cell, params, x_array,
                                                                       **run),
        "layer API forward (NumPy)": lambda: layer.forward(x_array),
    }


def _host_value(v: object) -> object:
    """``chain_graphs.value`` of a NumPy array in the replayed stand-in: what it reads of a CuPy
    array (address, shape, strides, dtype), ``id`` standing in for the address (NumPy's own,
    ``__array_interface__``, builds a dict: several times CuPy's ``data.ptr``, two attribute
    reads)."""
    if isinstance(v, np.ndarray):
        return (id(v), v.shape, v.strides, v.dtype.char)
    if isinstance(v, tuple):
        return tuple([_host_value(u) for u in v])  # (as ``value``)
    return v


def _host_addresses(arrays: dict, roles: tuple) -> tuple:
    """``chain_graphs.addresses`` in the replayed stand-in: ``id`` standing in for each
    address (CuPy's ``data.ptr``)."""
    return tuple(map(id, map(arrays.__getitem__, roles)))  # (as ``addresses``: in C)


def _looked_up(key: tuple, issue: Callable[[], None]) -> bool:
    """``chain_graphs.run`` in the replayed stand-in: the key hashed, as its look-up of the
    recorded graph hashes it; the replay itself stubbed."""
    return hash(key) is not None


def stubbed_entry_points(hidden: int, dtype: str = "float32", layers: int = 1,
                         bidirectional: bool = False, cell: str = "GRU"
                         ) -> dict[str, Callable[[], object]]:
    """The layer API's persistent forward and forward + backward (emulated path), for timing
    with the launcher stubbed (``main --stubbed``, which stubs ``EmulatedModule._launch``) and
    with the whole chain stubbed (stubbed here, around each call: about 1 µs of its own); the
    layer and the torch module in ``dtype``, of ``layers`` layers, ``bidirectional`` or not,
    of ``cell`` (GRU or LSTM)."""
    shape = {"num_layers": layers, "bidirectional": bidirectional}
    layer = getattr(prnn, cell)(hidden, hidden, algo="persistent", seed=0, dtype=dtype, **shape)
    x = np.random.default_rng(0).standard_normal((1, 1, hidden)).astype(layer.dtype)
    dy = np.ones((1, 1, hidden * layer.directions), layer.dtype)

    def train_step() -> object:
        layer.forward(x)
        return layer.backward(dy)

    def no_chain(call: Callable[[], object]) -> Callable[[], object]:
        def stubbed() -> object:
            issue = launch._issue_chain
            launch._issue_chain = lambda *a: None
            try:
                return call()
            finally:
                launch._issue_chain = issue
        return stubbed

    def replayed(call: Callable[[], object]) -> Callable[[], object]:
        def stand_in() -> object:
            saved = chain_graphs.value, chain_graphs.addresses, chain_graphs.run
            launch.Chain.on_device = True  # (NumPy words taken for device words)
            chain_graphs.value, chain_graphs.addresses = _host_value, _host_addresses
            chain_graphs.run = _looked_up
            try:
                return call()
            finally:
                launch.Chain.on_device = False  # (the class's default again)
                chain_graphs.value, chain_graphs.addresses, chain_graphs.run = saved
        return stand_in
    torch.manual_seed(0)
    module = getattr(prt, cell)(hidden, hidden, algo="persistent", **shape).to(
        getattr(torch, dtype))
    xt = torch.from_numpy(x.astype(np.float32)).to(getattr(torch, dtype)).requires_grad_()

    def module_forward() -> object:
        with torch.no_grad():
            return module(xt)

    def module_step() -> object:
        with torch.enable_grad():  # (the timing runs under no_grad)
            y, _ = module(xt)
            return y.float().sum().backward()
    return {"persistent forward, launcher stubbed (layer API)": lambda: layer.forward(x),
            "persistent forward+backward, launcher stubbed (layer API)": train_step,
            "persistent forward, chain stubbed (layer API)": no_chain(lambda: layer.forward(x)),
            "persistent forward+backward, chain stubbed (layer API)": no_chain(train_step),
            "persistent forward, replayed stand-in (layer API)": replayed(lambda: layer.forward(x)),
            "persistent forward+backward, replayed stand-in (layer API)": replayed(train_step),
            "persistent forward, chain stubbed (torch module)": no_chain(module_forward),
            "persistent forward+backward, chain stubbed (torch module)": no_chain(module_step)}


def main(argv: list[str] | None = None) -> int:
    """Time every entry point interleaved; print a table, write the JSON."""
    p = argparse.ArgumentParser(prog="bench/call_breakdown.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="output directory (created)")
    p.add_argument("--calls", type=int, default=100, help="timed calls per row and round")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--hidden", type=int, default=8)
    p.add_argument("--stubbed", action="store_true",
                   help="also the persistent layer call with the emulated launcher stubbed")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="the stubbed rows' layer and module dtype")
    p.add_argument("--layers", type=int, default=1, help="the stubbed rows' stacked layers")
    p.add_argument("--bidirectional", action="store_true", help="the stubbed rows' bidirectional")
    p.add_argument("--cell", default="GRU", choices=("GRU", "LSTM"), help="the stubbed rows' cell")
    p.add_argument("--no-stack", action="store_true",
                   help="the stack setting off: one layer-direction per launch")
    args = p.parse_args(argv)
    if args.no_stack:  # (the process's setting: a script's run)
        prnn.configure(stack=False)
    torch.set_num_threads(1)
    calls = entry_points(args.hidden)
    launcher = emulate.EmulatedModule._launch
    if args.stubbed:
        stubbed = stubbed_entry_points(args.hidden, args.dtype, args.layers, args.bidirectional,
                                       args.cell)
        for call in stubbed.values():  # the kernels built and every cache filled for real
            call()
        emulate.EmulatedModule._launch = lambda self, *a, **kw: None
        calls.update(stubbed)
    try:
        with torch.no_grad():
            times = time_roads(calls, args.calls, args.rounds, warmup=200)
    finally:
        emulate.EmulatedModule._launch = launcher
    rows = [{"entry": label, "median_us": statistics.median(ns) / 1e3,
             "p10_us": float(np.percentile(ns, 10)) / 1e3} for label, ns in times.items()]
    for row in rows:
        print(f"{row['entry']:40s} {row['median_us']:7.1f} µs  (p10 {row['p10_us']:6.1f})")
    if args.out is not None:
        doc = {"device": "cpu", "cpu_count": os.cpu_count(),
               "torch_version": torch.__version__, "numpy_version": np.__version__,
               "load_average_1_5_15_min": os.getloadavg(),
               **benchmark.run_stamp(["python", *sys.argv]),
               "settings": {"cell": args.cell, "hidden": args.hidden, "batch": 1, "steps": 1,
                            "dtype": args.dtype, "layers": args.layers,
                            "bidirectional": args.bidirectional, "stack": not args.no_stack,
                            "calls": args.calls, "rounds": args.rounds,
                            "stubbed": args.stubbed,
                            "timing": "time.perf_counter_ns per call under torch.no_grad, rows "
                                      "interleaved in runs of `calls`; median, 10th percentile"},
               "rows": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "call_breakdown.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out / 'call_breakdown.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
