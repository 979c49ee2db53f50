"""The correctness checks of the first GPU call (bench/first_call.py): one case at a time.

``check_case``: a layer of ``persistent_rnn.torch`` with ``algo="persistent"`` against torch.nn
on the same device (TF32 off) and torch.nn in float64 on the CPU, on the same weights and fresh
random inputs: forward and backward, every output and gradient; ``last_run`` must show the
persistent kernel on the expected path in both passes, on the TF32 tiles exactly where the case
allows them (``Case.settings``, its bound ``Case.tolerance``), with no restart and no fallback; a second
run on the same inputs must give the same bits (a race in a barrier-free exchange shows there
first). ``check_stall``: a stall injected into one CTA must make both passes restart and still
give the bits of the run without it.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any, Iterator

from first_cases import FORCE_GRID, Case, Stall

STALL = {"gpu": {"gpu_timeout_ms": 20.0, "stall_ms": 200.0},
         # the emulation's threads get scheduled late on a busy machine: a longer wait
         "cpu": {"emulation_timeout_ms": 600.0, "stall_ms": 1500.0}}


@contextlib.contextmanager
def configured(settings: dict, placement: str | None, cpu: bool) -> Iterator[None]:
    """The library's ``settings`` (a case's: ``Case.settings``) for the whole process while the
    case runs (``configure``: autograd runs the backward in a thread of its own, which
    ``override_settings`` does not reach), and in the emulation a grid case's tiny layer put on
    the grid (``FORCE_GRID``)."""
    import persistent_rnn as prnn
    wanted = {**settings, **(FORCE_GRID if cpu and placement == "grid" else {})}
    if not wanted:  # (``configure`` makes new settings: the layers would plan their calls anew)
        yield
        return
    before = {k: getattr(prnn.configure(), k) for k in wanted}
    prnn.configure(**wanted)
    try:
        yield
    finally:
        prnn.configure(**before)


def stats_dict(stats: Any) -> dict | None:
    """A ``RunStats`` (or ``LastRun``) as plain data, read at once (the next call replaces it)."""
    if stats is None:
        return None
    kernel = stats.details[0] if stats.details else ""  # the pass's kernel and its defines
    return {"algo": stats.algo, "restarts": stats.restarts, "fallback": stats.fallback,
            "emulated": stats.emulated, "launches": stats.launches,
            "placement": "cluster" if any("PRNN_CLUSTER" in d for d in stats.details) else "grid",
            # docs/api.md, "TF32": PRNN_MMA without PRNN_WEIGHT_DTYPE
            "tf32": "'PRNN_MMA'" in kernel and "PRNN_WEIGHT_DTYPE" not in kernel,
            "details": list(stats.details)[-3:]}


def path_problems(name: str, stats: dict | None, cpu: bool, placement: str | None,
                  tf32: bool = False) -> list[str]:
    """What is wrong with a pass that had to run the persistent kernel cleanly (on the TF32
    tiles where ``tf32``, else not)."""
    if stats is None:
        return [f"{name}: no last_run"]
    problems = []
    if stats["algo"] != "persistent" or stats["fallback"] or stats["restarts"]:
        problems.append(f"{name} ran {stats['algo']} (restarts {stats['restarts']}, fallback "
                        f"{stats['fallback']})")
    if stats["emulated"] != cpu:
        problems.append(f"{name}: emulated {stats['emulated']} on {'CPU' if cpu else 'GPU'}")
    if placement and stats["placement"] != placement:
        problems.append(f"{name} ran on the {stats['placement']} path, not the {placement} path")
    if stats["tf32"] != tf32:
        problems.append(f"{name} ran {'' if stats['tf32'] else 'not '}on the TF32 tiles")
    return problems


def relative_error(got, want) -> float:
    """max |got - want| / max |want| in float64; inf where ``got`` is not finite or misshapen."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape or not bool(got.isfinite().all()):
        return math.inf
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


class _Inputs:
    """Fresh random inputs of a case (seeded by its name), in float32 on the CPU."""

    def __init__(self, case: Case):
        import torch
        gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
        directions = 2 if case.options.get("bidirectional") else 1
        states = case.options.get("num_layers", 1) * directions
        width = case.options.get("proj_size") or case.hidden
        lstm = case.mode == "LSTM"

        def draw(*shape, scale=1.0):
            return torch.randn(*shape, generator=gen) * scale
        self.x = draw(case.steps, case.batch, case.input_size)
        self.h0 = draw(states, case.batch, width, scale=0.5)
        self.c0 = draw(states, case.batch, case.hidden, scale=0.5) if lstm else None
        self.grads = [draw(case.steps, case.batch, directions * width), draw(states, case.batch, width)]
        if lstm:
            self.grads.append(draw(states, case.batch, case.hidden))
        self.lengths = ([case.steps - (3 * i) % case.steps for i in range(case.batch)]
                        if case.lengths else None)


def run_module(module, inputs: _Inputs, device: str, dtype) -> dict:
    """Forward and backward of ``module`` on ``inputs`` cast to ``device``/``dtype``: every
    output and gradient by name."""
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    def leaf(t):
        return None if t is None else t.to(device, dtype).requires_grad_()
    x, h0, c0 = leaf(inputs.x), leaf(inputs.h0), leaf(inputs.c0)
    hx = h0 if c0 is None else (h0, c0)
    if inputs.lengths is None:
        y, hn = module(x, hx)
    else:
        out, hn = module(pack_padded_sequence(x, inputs.lengths, enforce_sorted=False), hx)
        y = pad_packed_sequence(out, total_length=x.shape[0])[0]
    outs = {"y": y, "h_n": hn if c0 is None else hn[0]}
    if c0 is not None:
        outs["c_n"] = hn[1]
    leaves = {"dx": x, "dh0": h0, **({"dc0": c0} if c0 is not None else {}),
              **{f"d_{k}": p for k, p in module.named_parameters()}}
    grads = torch.autograd.grad(list(outs.values()), list(leaves.values()),
                                [g.to(device, dtype) for g in inputs.grads], allow_unused=True)
    result = {k: v.detach() for k, v in outs.items()}
    result.update({k: g.detach() for k, g in zip(leaves, grads) if g is not None})
    return result


def _worst(errors: dict[str, float]) -> tuple[float | None, str | None]:
    if not errors:
        return None, None
    name = max(errors, key=errors.get)
    return errors[name], name


def check_case(case: Case, cpu: bool) -> dict:
    """Run ``case`` (see the module docstring); a record with ``ok`` and ``problems``."""
    import torch
    import persistent_rnn.torch as prnn_torch
    device, dtype = ("cpu" if cpu else "cuda"), getattr(torch, case.dtype)
    torch.manual_seed(zlib.crc32(case.name.encode()))
    ours = getattr(prnn_torch, case.mode)(case.input_size, case.hidden, algo="persistent",
                                          **case.options).to(device, dtype)
    twin = getattr(torch.nn, case.mode)(case.input_size, case.hidden, **case.options).to(device, dtype)
    twin.load_state_dict(ours.state_dict())
    exact = getattr(torch.nn, case.mode)(case.input_size, case.hidden, **case.options).double()
    exact.load_state_dict({k: v.double().cpu() for k, v in ours.state_dict().items()})
    inputs = _Inputs(case)
    with configured(case.settings, case.placement, cpu):
        got = run_module(ours, inputs, device, dtype)
        forward = stats_dict(ours.last_run)
        backward = stats_dict(getattr(ours.last_run, "backward", None))
        again = run_module(ours, inputs, device, dtype)
    want = run_module(exact, inputs, "cpu", torch.float64)
    rec: dict[str, Any] = {"hidden": case.hidden, "batch": case.batch, "steps": case.steps,
                           "dtype": case.dtype, "options": case.options, "lengths": inputs.lengths,
                           "settings": case.settings, "forward": forward, "backward": backward}
    problems = path_problems("forward", forward, cpu, case.placement, case.tf32)
    problems += path_problems("backward", backward, cpu, case.placement, case.tf32)
    rec["repeat_bitwise"] = got.keys() == again.keys() and all(
        torch.equal(got[k], again[k]) for k in got)
    if not rec["repeat_bitwise"]:
        problems.append("two runs on the same inputs differ in their bits (a race?)")
    ours_f64 = {k: relative_error(got[k], want[k]) for k in want if k in got}
    missing = sorted(set(want) - set(got))
    if missing:
        problems.append(f"no {', '.join(missing)}")
    rec["err_f64"], rec["worst"] = _worst(ours_f64)
    rec["errors_f64"] = {k: float(f"{v:.3e}") for k, v in ours_f64.items()}
    try:
        theirs = run_module(twin, inputs, device, dtype)
    except (RuntimeError, NotImplementedError) as exc:  # torch.nn has no kernel for this here
        rec["torch_nn_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if not cpu:
            problems.append("torch.nn did not run on the GPU: " + rec["torch_nn_error"])
    else:
        rec["err_torch_nn"], _ = _worst({k: relative_error(got[k], theirs[k]) for k in theirs})
        rec["torch_nn_err_f64"], _ = _worst({k: relative_error(theirs[k], want[k]) for k in want})
    tolerance = case.tolerance()
    for key, what in (("err_f64", "float64"), ("err_torch_nn", "torch.nn")):
        if rec.get(key) is not None and not rec[key] <= tolerance:
            problems.append(f"error against {what} {rec[key]:.2e} > {tolerance:g}")
    rec.update(tolerance=tolerance, problems=problems, ok=not problems)
    return rec


def check_stall(stall: Stall, cpu: bool) -> dict:
    """Run ``stall`` (see the module docstring); a record with ``ok`` and ``problems``."""
    import numpy as np
    import persistent_rnn as prnn
    xp = np if cpu else __import__("cupy")
    layer = getattr(prnn, stall.mode)(24, stall.hidden, num_layers=stall.num_layers,
                                      algo="persistent", seed=1)
    rng = np.random.default_rng(zlib.crc32(stall.name.encode()))
    lstm = stall.mode == "LSTM"

    def draw(*shape):
        return xp.asarray(rng.standard_normal(shape).astype(np.float32))
    x, dy = draw(stall.steps, stall.batch, 24), draw(stall.steps, stall.batch, stall.hidden)
    states = [draw(stall.num_layers, stall.batch, stall.hidden) for _ in range(2 if lstm else 1)]

    def run() -> tuple[list, dict, dict]:
        layer.zero_grad()
        y, hn = layer.forward(x, tuple(states) if lstm else states[0])
        forward = stats_dict(layer.last_run)
        dx, dhx = layer.backward(dy)
        results = [y, *(hn if lstm else (hn,)), dx, *(dhx if lstm else (dhx,)),
                   *(g.copy() for g in layer.grads.values())]
        return results, forward, stats_dict(layer.last_run)

    limits = STALL["cpu" if cpu else "gpu"]
    with configured({}, stall.placement, cpu):
        plain, plain_fwd, plain_bwd = run()
        again, _, _ = run()
        with prnn.override_settings(residency_cooldown_s=0.0,
                                    **{k: v for k, v in limits.items() if k != "stall_ms"}):
            with prnn.inject_stall(block=stall.block, step=stall.steps // 2,
                                   duration_ms=limits["stall_ms"]):
                stalled, fwd, bwd = run()
    same = [bool(xp.array_equal(a, b)) for a, b in zip(plain, stalled)]
    problems = (path_problems("plain forward", plain_fwd, cpu, stall.placement)
                + path_problems("plain backward", plain_bwd, cpu, stall.placement))
    for name, stats in (("stalled forward", fwd), ("stalled backward", bwd)):
        if stats["restarts"] < 1:
            problems.append(f"{name}: no restart")
        if stats["fallback"] or stats["algo"] != "persistent":
            problems.append(f"{name} fell back to {stats['algo']}: {stats['fallback']}")
    if not all(bool(xp.array_equal(a, b)) for a, b in zip(plain, again)):
        problems.append("two runs without a stall differ in their bits (a race?)")
    if not all(same):
        problems.append(f"{same.count(False)} of {len(same)} results differ after the restart")
    return {"hidden": stall.hidden, "batch": stall.batch, "steps": stall.steps,
            "num_layers": stall.num_layers, "block": stall.block, **limits,
            "plain_forward": plain_fwd, "stalled_forward": fwd, "stalled_backward": bwd,
            "restart_bitwise": all(same), "problems": problems, "ok": not problems}
