"""The resident decoder: a layer's W_hh stays in registers between single steps.

``cell.decoder(batch=B)`` (``prnn.RNNCell``/``GRUCell``/``LSTMCell``) and ``layer.decoder(batch=B)``
(``prnn.RNN``/``GRU``/``LSTM``, unidirectional, no projection) return a decoder whose
``step(x, state)`` advances one step (docs/api.md, "The resident decoder"). Its persistent kernel
(``cuda_src/resident_decoder.cu``; one launch for all the layers of a stack, its grid the
layers' grids side by side) is launched once on a stream of its own, loads its rows of W_hh
into registers as the whole-sequence forward does and waits - bounded by the exchange's
deadline (``gpu_timeout_ms``, ``emulation_timeout_ms``) - for each step's post. A step enqueues
on the caller's stream one step kernel (``prnn_decoder_step``; one launch for all the layers of
a stack) that posts the step's pointers to the layer's mailbox and waits until every resident
CTA of the layer has written its units of h_t, then does the same for the next layer; a slice
whose resident CTA has gone (idle past its deadline) the step kernel computes itself with the
same rows and the same code, so a step's bits never depend on who computed it. Each CTA computes its own rows of the input projection ``x W_ih^T + b_ih`` inside
the step (its rows of W_ih held in its shared memory from its launch on where they fit a block,
``DecoderPlan.w_ih_held``, else read from L2 each step; x staged in shared memory; fp32 sums in
one fixed order either way), so the step needs no matrix product of its own; a further layer's
x is the h' the layer below wrote earlier in the same launch. Each resident CTA computes its
recurrent half (W_hh h_{t-1} + b_hh) ahead, between steps, from the layer's own last h' (a
``keep`` buffer every step writes), and uses it when the caller's h_{t-1} is bitwise that h
(else computes it in the step: the same sums either way). Those sums are not the whole-sequence
path's GEMM's: ``step(x)`` matches the float64 reference and torch.nn to float32 round-off, not
the sequence kernel's bits. ``step_projected(gi)`` takes the caller's projection (b_ih
included) and is bitwise the sequence kernel's step on the same gi.

So a step is one launch and no host synchronisation, and capturable in a CUDA graph
(fresh outputs per step, as torch.nn's cell). Before a step the host asks, without waiting,
whether the resident launch has ended (a stream query; the emulation's ``AsyncLaunch.done``) and
relaunches it; a relaunched CTA takes its slice back from the state word. Nothing hangs: every
wait is bounded, and a step kernel whose wait ran past ``WAIT_DEADLINES`` deadlines (a resident
CTA stuck inside a step) records the step in a fault word that the host raises on (at once in
the emulation, at ``check()``/``close()`` on a GPU). The deadlines are the settings read when
the resident kernel is launched (the decoder's creation, each relaunch), not at every step.

A steady-state step is cheap on the host (an eager step is host-bound on a GPU): what a loop
passes back - arrays of the decoder's type, dtype and shape, C-contiguous - passes identity and
shape checks, anything else the full checks and their errors; the step kernel's constant
arguments are made once per launch of the resident kernel (docs/design.md, "The host's share
of a step").

The rule for big layers: the step kernel's one CTA must find an SM beside the resident grid (one
CTA per SM, as the planner sizes the tiles), so a decoder is resident only where grid < SM count
(an H100's 132 SMs: every fp32 LSTM and GRU up to H = 1024 at B = 1, whose grid tile is 128
CTAs). Otherwise, and for float64, the decoder says why (``reason``, a ``RuntimeWarning``) and
runs the fused step kernel (``cell_step.fused_step``) on the GPU, or the GEMM step elsewhere
(``fallback``: ``cell_step.step_forward``); so does a layer whose staged x (batch x input_size
floats) leaves the kernel's shared memory past a block's (``plan``).
The resident kernel holds its ``grid`` SMs (``sms_held``) for the decoder's life: the caller's
own kernels get the rest.

The cell's or layer's ``algo`` decides as for its calls (``Decoder._algo_reason``): ``"gemm"``
runs the GEMM step, and so does ``"auto"`` on NumPy arrays. With ``algo="persistent"`` on NumPy
arrays the decoder runs in the CPU emulation (a test path): the resident kernel is an
asynchronous emulated launch (``emulate.EmulatedModule.launch_async``).
"""
from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import hardware, launch, plan as planner, settings
from .buffers import array_module, weight_words
from .cells import CellSpec
from . import validation

Array = Any

SOURCE = "resident_decoder.cu"
BOX_WORDS = 16      # the mailbox: the posted step, a spare word, seven pointers as word pairs
CONTROL_WORDS = 16  # the kernels' shared words after the staged vectors, partial sums and gi rows
GONE = 1            # state word of a slice nobody holds, at step 0 (resident_decoder.cu, kGone)
STOP = 0xFFFFFFFF   # posted by close(): every resident CTA is then stale and exits
WAIT_DEADLINES = 4  # a step kernel waits this many idle deadlines for a resident CTA
JOIN_S = 30.0       # close(): the longest wait for the resident launch to end (emulation)
PROJ_BATCH = 4      # batch rows one pass over a CTA's W_ih rows serves (kProjBatch; the model)
PROJ_ROWS = 4       # W_ih rows one pass over the staged x serves (kProjRows; the model)
_GIVEN_X, _GIVEN_GI = np.int32(1), np.int32(0)  # the step kernel's flag: x given, or gi
# The probe (resident_decoder.cu, PRNN_DECODER_PROBE; bench/decoder_probe.py): with PROBE_ENV=1
# in the environment when a decoder is made, its kernels are built with the probe (-D of the same
# name), which stamps each stage of a step of a one-layer decoder (%globaltimer ns, and the SM's
# clock) into row step % PROBE_STEPS of a device buffer (``probe_buffer``); the shipped kernels
# have no probe.
PROBE_ENV = "PRNN_DECODER_PROBE"
# An experiment beside it (bench/decoder_probe.py --free-polls): with FREE_POLLS_ENV=N in the
# environment when a decoder is made, its kernels' hand-off waits poll N times before they sleep
# between polls (-D PRNN_DECODER_FREE_POLLS=N; the shipped kernels sleep after every miss).
FREE_POLLS_ENV = "PRNN_DECODER_FREE_POLLS"
PROBE_SYMBOL = "prnn_decoder_probe"
PROBE_STEPS, PROBE_CTAS = 256, 160  # kProbeSteps, kProbeCtas
PROBE_CHAIN, PROBE_CTA_WORDS = 16, 32  # kProbeChain (word w's SM clock at PROBE_CHAIN + w),
                                      # kProbeCtaWords
PROBE_WORDS = ("step", "start", "posting", "done_seen", "end", "done_polls",  # (ProbeWord)
               "wait_start", "post_seen", "post_polls", "staged", "projected", "gathered",
               "pointwise", "publishing", "ahead")


@dataclass(frozen=True)
class DecoderPlan:
    """One layer's part of the resident kernel's launch (a stack's layers side by side in one
    launch: ``_Resident``): the layer forward's tile (its -D), grid,
    block, the layer's input size and the shared memory (``resident_decoder.cu``'s layout:
    ``shared_layout`` is the one place that sizes it): ``shared_bytes`` the step kernel's, and
    ``resident_shared_bytes`` the resident kernel's - with its CTA's rows of W_ih
    (``w_ih_rows`` of them) where they fit a block (``w_ih_held``), so that a step's projection
    reads them from shared memory, not L2."""

    defines: dict[str, int]
    grid: int
    block: int
    input_size: int
    shared_bytes: int
    resident_shared_bytes: int
    w_ih_held: bool
    w_ih_rows: int

    def w_ih_note(self) -> str:
        """Where a step's projection reads W_ih from, and why (``prnn plan --decoder``)."""
        held = 4 * self.w_ih_rows * self.input_size
        if self.w_ih_held:
            return (f"W_ih held in shared memory ({self.w_ih_rows} rows x {self.input_size} "
                    f"columns, {held} B a CTA, loaded at each launch)")
        return (f"W_ih read from L2 each step: its {self.w_ih_rows} rows x {self.input_size} "
                f"columns ({held} B a CTA) do not fit a block's shared memory beside the "
                f"step's {self.shared_bytes} B")


def plan(cell: CellSpec, hidden: int, batch: int, device: hardware.DeviceProfile,
         input_size: int | None = None) -> tuple[DecoderPlan | None, str | None]:
    """The resident plan of a layer (``input_size``: its input's width, default ``hidden``) on
    ``device``, or ``(None, why not)``: the tile of the layer's own forward there
    (``plan.make_plan``), so that a step sums W_hh's product as that kernel does. A cluster tile
    is built without ``PRNN_CLUSTER`` (the step kernel's one CTA could not launch as a cluster)
    and with ``PRNN_WORD_SPAN`` (its lanes take their columns as the cluster kernel's do). The
    rule for big layers: the step kernel's CTA needs an SM beside the resident grid (one CTA
    per SM, as the planner sizes the tiles), so grid < SM count. The shared memory - h_{t-1} and
    x staged, the partial sums, the CTA's rows of gi, CONTROL_WORDS - must fit one block; the
    resident kernel's CTA adds its rows of W_ih where they fit too (``w_ih_held``)."""
    inputs = hidden if input_size is None else input_size
    # (fp32 tiles only: the resident kernel has no TF32 tile, whatever settings.allow_tf32 says)
    layer_plan = planner.make_plan(cell, hidden, batch, "float32", replace(device, allow_tf32=False))
    if not layer_plan.fits:
        return None, f"the layer's persistent kernel does not fit: {layer_plan.reason}"
    fwd = layer_plan.forward
    if fwd.grid >= device.sm_count:
        return None, (f"its kernel takes the whole GPU ({fwd.grid} CTAs, one per SM, on "
                      f"{device.sm_count} SMs): the step kernel's CTA would have no SM beside it "
                      f"(the rule: grid < SM count)")
    d = {k: v for k, v in fwd.defines.items() if not k.startswith("PRNN_SMEM_")}
    if d.pop("PRNN_CLUSTER", None) is not None:
        d["PRNN_WORD_SPAN"] = 1
    layout = shared_layout(cell, d, fwd.exchange_row, inputs)
    d.update(planner.layout_defines(layout))
    shared = planner.layout_bytes(layout, batch)
    limit = min(device.shared_per_block, device.shared_per_sm)
    if shared > limit:
        return None, (f"its shared memory ({shared} bytes: h and x staged, input_size {inputs}, "
                      f"batch {batch}) exceeds the {limit} bytes of a block on {device.name}")
    rows = cell.gates * d["PRNN_UNITS"]  # the CTA's rows of W_hh and W_ih
    held = planner.layout_bytes(layout + (held_w_ih(rows, inputs),), batch)
    fits = held <= limit
    return DecoderPlan(d, fwd.grid, fwd.block, inputs, shared, held if fits else shared, fits,
                       rows), None


def plan_layers(cell: CellSpec, hidden: int, batch: int, device: hardware.DeviceProfile,
                input_size: int, layers: int) -> tuple[list[DecoderPlan], str | None]:
    """Every layer's resident plan (``plan``: layer 0's input is x, a further layer's the h'
    below it), or ``([], why not)``. The rule for big layers holds for the stack: the one
    resident launch's CTAs (every layer's grid) and the step kernel's CTA each need an SM, so
    the layers' CTAs together stay below the SM count."""
    plans = []
    for n in range(layers):
        dp, why = plan(cell, hidden, batch, device, input_size if n == 0 else hidden)
        if dp is None:
            return [], why if n == 0 else f"layer {n}: {why}"
        plans.append(dp)
    held = sum(dp.grid for dp in plans)
    if layers > 1 and held >= device.sm_count:
        return [], (f"its {layers} layers' kernels take the whole GPU ({held} CTAs, one per SM, "
                    f"on {device.sm_count} SMs): the step kernel's CTA would have no SM beside "
                    f"them (the rule: the layers' CTAs < SM count)")
    return plans, None


class DecoderContextLost(RuntimeError):
    """The CUDA context of a resident decoder was reset (``cudaDeviceReset``) or failed (a
    sticky error): its kernels, weights and words are gone. The decoder is closed (its
    ``close()`` and garbage collection touch the device no more); make a new one, from weights
    and a state on the new context."""


def _lost_errors(xp) -> tuple[type[BaseException], ...]:
    """What a query of the resident launch raises once its context is gone."""
    if xp is np:
        from . import emulate
        return (emulate.ContextReset,)
    return (xp.cuda.runtime.CUDARuntimeError,)


def shared_layout(cell: CellSpec, defines: Mapping[str, int], padded: int,
                  inputs: int) -> tuple[planner.SharedRegion, ...]:
    """``resident_decoder.cu``'s shared memory, region by region in its order (per batch row
    unless said; the kernel carves it from ``-D PRNN_SMEM_<name>``, ``plan.shared_layout``):
    h_{t-1} staged, STAGED [padded] (the forward tile's row); x_t staged, input_size floats
    padded to whole quads (a launch argument's row: the kernel's ``padded_input``, no define);
    the product's partial sums, PARTIAL [ksplit][G*units]; the CTA's rows of gi, GI [G*units];
    CONTROL_WORDS words in all, WORDS."""
    rows = cell.gates * defines["PRNN_UNITS"]  # the CTA's rows of W_hh and W_ih
    region = planner.SharedRegion
    return (region("STAGED", padded), region("X", -(-inputs // 4) * 4, argument=True),
            region("PARTIAL", defines["PRNN_KSPLIT"] * rows), region("GI", rows),
            region("WORDS", CONTROL_WORDS, per_row=False))


def held_w_ih(rows: int, inputs: int) -> planner.SharedRegion:
    """The resident kernel's region after ``shared_layout``'s: its CTA's ``rows`` rows of W_ih,
    ``inputs`` floats each (a launch argument's width: no define), where the plan holds them."""
    return planner.SharedRegion("W_IH", rows * inputs, per_row=False, argument=True)


def _free_polls() -> dict[str, int]:
    """The ``-D PRNN_DECODER_FREE_POLLS`` of ``FREE_POLLS_ENV`` (none where it is not set);
    ValueError naming it for anything but a count >= 0."""
    text = os.environ.get(FREE_POLLS_ENV, "")
    if not text:
        return {}
    if not text.isdigit():
        raise ValueError(f"{FREE_POLLS_ENV} must be a count of polls >= 0, got {text!r}")
    return {FREE_POLLS_ENV: int(text)}


def _module(xp, defines: Mapping[str, int]):
    if xp is np:
        from . import emulate
        return emulate.get_module(SOURCE, defines)
    from . import kernels
    return kernels.get_module(SOURCE, defines)


class _Resident:
    """The resident kernel of a decoder: one launch for all its layers (its grid the layers'
    grids side by side, CTA ``n * slices + c`` slice c of layer n), relaunched when it has ended,
    and its stop. Its operands are the layers' stacked ones (``_Layers``). Holds no reference to
    the decoder, so that garbage collection of the decoder can stop it (``weakref.finalize``)."""

    def __init__(self, xp, module, plans: Sequence[DecoderPlan], operands: tuple, batch: int,
                 hidden: int):
        self.xp, self.plans, self.batch, self.hidden = xp, list(plans), batch, hidden
        self.module = module
        self.slices = plans[0].grid  # (every layer's: the tile depends on the cell, H and B)
        self.grid = len(plans) * self.slices
        # Each CTA carves its layer's shared memory: the launch's is the largest layer's
        self.shared_bytes = max(q.resident_shared_bytes for q in plans)
        # Layer 0's held rows of W_ih (bit 0) and the further layers' (bit 1: input size H)
        self.w_ih_held = int(plans[0].w_ih_held) | int(plans[-1].w_ih_held and len(plans) > 1) << 1
        # W_hh's words, b_hh, W_ih, the mailboxes, the state words, the fault words and each
        # layer's own copy of its last two steps' h' (the recurrent half computed ahead reads it)
        self.w_hh, self.b_hh, self.w_ih, self.box, self.state, self.fault, self.keep = operands
        self.running: Any = None  # emulate.AsyncLaunch, or the CuPy stream of the launch
        self.launches = 0
        self.closed = False
        self.lost: str | None = None  # why the context is gone (DecoderContextLost)
        self._lost_errors = _lost_errors(xp)

    def ended(self) -> bool:
        """Whether the resident launch has ended (asked without waiting: the emulated launch's
        ``done()``, a CuPy stream's ``done``, cudaStreamQuery). DecoderContextLost where the
        query says the context was reset or failed: the launch and the words are gone, so the
        resident kernel is then closed, with nothing left to stop or free."""
        if self.running is None:
            return True
        try:
            return self.running.done() if self.xp is np else self.running.done
        except self._lost_errors as exc:
            self.running, self.closed = None, True
            self.lost = (f"its CUDA context was reset or failed ({type(exc).__name__}: {exc}); "
                         "its kernels, weights and words are gone - make a new decoder")
            raise DecoderContextLost(f"resident decoder: {self.lost}") from exc

    def relaunch(self) -> int:
        """Launch the resident kernel, reading the settings now: its idle deadline (returned:
        the step kernel's wait is ``WAIT_DEADLINES`` of them), the stall, the emulation's
        residency."""
        stall = settings.current_stall()
        timeout = launch.timeout_ns(self.xp is np)
        args = (self.w_hh, self.b_hh, self.w_ih, self.box, self.state, self.keep,
                np.int32(self.slices), np.int32(self.batch), np.int32(self.plans[0].input_size),
                np.int32(self.hidden), np.int32(self.w_ih_held), np.uint64(timeout),
                *stall.arguments)
        block = self.plans[0].block
        if self.xp is np:  # (a busy GPU: emulation_max_resident CTAs at a time, as the runtime)
            self.running = self.module.launch_async(
                "prnn_resident_decoder", self.grid, block, self.shared_bytes, args,
                max_resident=settings.current().emulation_max_resident)
        else:
            stream = self.running or self.xp.cuda.Stream(non_blocking=True)
            stream.wait_event(self.xp.cuda.get_current_stream().record())  # the words, zeroed
            with stream:
                self.module.launch("prnn_resident_decoder", self.grid, block, self.shared_bytes,
                                   args)
            self.running = stream
        self.launches += 1
        launch.COUNTERS.add("launches")
        return timeout

    def raise_fault(self) -> None:
        """RuntimeError naming the first layer whose fault word records a step (reads them)."""
        if self.lost is not None:
            return
        for n, step in enumerate(int(f) for f in self.fault):
            if step:
                where = f" of layer {n}" if len(self.plans) > 1 else ""
                raise RuntimeError(f"resident decoder: the wait{where} of step {step} ran past "
                                   f"{WAIT_DEADLINES} deadlines (a resident CTA neither finished "
                                   "the step nor left); its outputs are not written")

    def stop(self) -> None:
        """Post STOP and wait (bounded) for the resident launch to end. Idempotent."""
        if self.closed:
            return
        try:
            self.ended()  # (a context lost since the last step: nothing to stop or free)
        except DecoderContextLost:
            return
        self.closed = True
        if self.running is None:
            return
        # each layer's mailbox's posted step (the CTAs read it with acquire loads; on a GPU
        # the fill runs on the current stream, not the resident one)
        self.box[::BOX_WORDS].fill(STOP)
        if self.xp is np:
            self.running.join(JOIN_S)
        else:
            self.running.synchronize()
        self.running = None


class _Layers:
    """A resident decoder's layers (a cell: one): their weights and words stacked - what the one
    step kernel of a step and the one resident launch (``resident``) read, layer n at its
    offsets (``resident_decoder.cu``, ``layer_weights``). All layers share the tile (it depends
    on the cell, hidden size and batch, not the input size), so one module serves them."""

    def __init__(self, xp, plans: Sequence[DecoderPlan], params: Sequence[Mapping[str, Array]],
                 cell: CellSpec, batch: int, hidden: int):
        layers, gh, dp = len(plans), cell.gates * hidden, plans[0]
        self.xp, self.batch, self.hidden, self.input_size = xp, batch, hidden, dp.input_size
        self.probe = os.environ.get(PROBE_ENV, "") == "1"
        if self.probe and layers > 1:
            raise ValueError(f"{PROBE_ENV}=1: the probe stamps a one-layer decoder's steps")
        self.module = _module(xp, {**dp.defines, **({PROBE_ENV: 1} if self.probe else {}),
                                   **_free_polls()})
        w_hh = xp.stack([weight_words(xp, p["weight_hh"], None) for p in params])
        b_hh = xp.stack([p.get("bias_hh", xp.zeros(gh, np.float32)) for p in params])
        w_ih = xp.concatenate([p["weight_ih"].reshape(-1) for p in params])  # (input, then H)
        b_ih = xp.stack([p["bias_ih"] for p in params]) if "bias_ih" in params[0] else None
        box = xp.zeros(layers * BOX_WORDS, np.uint32)  # layer n's at n * BOX_WORDS
        state = xp.full(layers * dp.grid, GONE, np.uint32)  # layer n's at n * grid
        fault = xp.zeros(layers, np.uint32)
        keep = xp.zeros((layers, 2, batch, hidden), np.float32)  # each layer's last two h'
        words = (w_hh, b_hh, w_ih, box, state, fault, keep)
        self.resident = _Resident(xp, self.module, plans, words, batch, hidden)
        # The step kernel's arguments that no step changes, made once (a step then joins three
        # tuples): the words, the block and shared memory (the widest layer's: its staged x),
        # and the tail - b_ih and its flag (layer 0 adds it only to its own projection of x),
        # the sizes and the wait deadline (``_step_tail``: made again at each launch of a
        # resident kernel from the settings read then).
        self._words = words
        self._bias = (b_ih, np.int32(1)) if b_ih is not None else (b_hh, np.int32(0))
        self._launch_step = _step_launcher(xp, self.module, dp.block,
                                           max(q.shared_bytes for q in plans))
        self._count = np.int32(layers)
        self._step_tail = self._tail(launch.timeout_ns(xp is np))

    def ensure(self) -> None:
        """Relaunch the resident kernel if its last launch has ended (every CTA idle past its
        deadline); the step kernel's wait then follows the deadline of the new launch. Not
        while the current stream is being captured (the query is not allowed then, and a launch
        on another stream would not be in the graph): a replayed step whose resident CTAs have
        gone takes their slices over."""
        if self.xp is not np and self.xp.cuda.get_current_stream().is_capturing():
            return
        if self.resident.ended():
            self._step_tail = self._tail(self.resident.relaunch())

    def _tail(self, timeout_ns: int) -> tuple:
        """The step kernel's last arguments: the bias and its flag, the layers and sizes, and
        its wait (``WAIT_DEADLINES`` idle deadlines of the resident kernel, ``timeout_ns``
        each)."""
        return self._bias + (self._count, np.int32(self.resident.slices),
                             np.int32(self.batch), np.int32(self.input_size),
                             np.int32(self.hidden), np.uint64(WAIT_DEADLINES * timeout_ns))

    def step(self, x: Array | None, gi: Array | None, h: Array, c: Array | None,
             h_out: Array, c_out: Array | None) -> None:
        """Enqueue the next step of every layer (the kernel numbers it: each mailbox's box[1]):
        one launch. Exactly one of ``x`` (batch, input_size; the kernels project it and add
        b_ih) and ``gi`` (the caller's x W_ih^T + b_ih for layer 0, b_ih included) is given;
        ``h``, ``c``, ``h_out``, ``c_out``: (layers, batch, H) or a cell's (batch, H); every
        array C-contiguous."""
        self.ensure()
        args = self._words + (gi if x is None else x, _GIVEN_GI if x is None else _GIVEN_X, h,
                              h if c is None else c, h_out, h_out if c_out is None else c_out
                              ) + self._step_tail
        self._launch_step(args)
        launch.COUNTERS.add("launches")
        if self.xp is np and self.resident.fault.any():  # (free to read in the emulation;
            self.resident.raise_fault()                  # a GPU: check())


def _step_launcher(xp, module, block: int, shared_bytes: int) -> Callable[[tuple], None]:
    """The step kernel's launch (one CTA of ``block`` threads, ``shared_bytes`` of dynamic shared
    memory) as a call of its arguments alone, made once per decoder: on a GPU CuPy's kernel
    function itself (its shared-memory attribute set now), so that a step runs no Python of the
    launcher's (``kernels.GpuModule.launch``, ``function``); in the emulation its launch."""
    if xp is np:
        return functools.partial(module.launch, "prnn_decoder_step", 1, block, shared_bytes)
    kernel = module.function("prnn_decoder_step", shared_bytes)
    return functools.partial(kernel, (1,), (block,), shared_mem=shared_bytes)


def probe_buffer(dec: "Decoder") -> Array:
    """The probe's rows of a decoder made with ``PROBE_ENV=1`` (``PROBE_STEPS`` rows of uint64
    words: ``PROBE_WORDS``, from ``PROBE_CHAIN`` on the SM clock of each of them that is a
    stamp, then each resident CTA's post seen and done word released, from ``PROBE_CTA_WORDS``
    on): a view of the device buffer (a CuPy array; the emulation's, a NumPy array), to zero
    before a loop and read after it."""
    layers = dec._layers
    if layers is None or not layers.probe:
        raise ValueError(f"probe_buffer(): the decoder is not resident with the probe ({PROBE_ENV}=1)")
    shape, words = (PROBE_STEPS, PROBE_CTA_WORDS + 2 * PROBE_CTAS), np.dtype(np.uint64)
    if layers.xp is np:
        import ctypes
        raw = (ctypes.c_ulonglong * (shape[0] * shape[1])).in_dll(layers.module._lib, PROBE_SYMBOL)
        return np.ctypeslib.as_array(raw).reshape(shape)
    memory = layers.module._module.get_global(PROBE_SYMBOL)
    return layers.xp.ndarray(shape, words, memptr=memory)


def stop(resident: _Resident | None) -> None:
    """Stop the resident kernel, if any (a decoder's finaliser)."""
    if resident is not None:
        resident.stop()


class Decoder:
    """Single steps of a cell or a unidirectional layer with its recurrent weights resident.

    Made by ``cell.decoder(batch=B)`` or ``layer.decoder(batch=B)``; a context manager
    (``close()`` on exit). ``resident``: whether the resident kernel runs; ``reason``: why not
    (the fused step kernel or the GEMM step runs each step instead). The weights are those of
    the decoder's creation (the resident kernel holds them)."""

    def __init__(self, cell: CellSpec, layers: Sequence[Mapping[str, Array]], batch: int,
                 input_size: int, hidden: int, stacked: bool, fallback: Callable[..., tuple],
                 algo: str):
        self.batch = validation.positive_int("batch", batch)
        self.algo = algo  # the cell's or layer's (``_algo_reason``)
        self.cell, self.input_size, self.hidden = cell, input_size, hidden
        self._stacked = stacked  # a layer's state (L, B, H); a cell's (B, H)
        self._fallback = fallback  # cell_step.step_forward (passed in: no import cycle)
        # Copies: the resident kernel holds W_hh as it is now, and reads W_ih from its own copy
        # (an optimizer updating the caller's arrays changes neither). A resident decoder keeps
        # only the layers' stacked copy (``_Layers``), the fallback the per-layer ones.
        self._params = [{k: array_module(v).array(v) for k, v in p.items()} for p in layers]
        xp = self._xp = array_module(self._params[0]["weight_hh"])
        self.dtype = np.dtype(self._params[0]["weight_hh"].dtype)
        self._lock = threading.Lock()
        self._lost: str | None = None  # why the decoder closed itself (DecoderContextLost)
        # What a step's fast checks compare with (``_plain``)
        self._array_type = type(self._params[0]["weight_hh"])
        self._lstm = cell.has_cell_state
        self._x_shape = (self.batch, input_size)
        self._gi_shape = (self.batch, cell.gates * hidden)
        self._state_shape = (len(layers), self.batch, hidden) if stacked else (self.batch, hidden)
        self._joint_shape = (1 + self._lstm, *self._state_shape)  # (a resident step's outputs)
        chosen = self._algo_reason(xp)
        plans, why = ([], chosen) if chosen else self._plans(cell, hidden, xp)
        self.reason = why
        self._layers = (_Layers(xp, plans, self._params, cell, self.batch, hidden)
                        if plans else None)
        self._resident = self._layers.resident if plans else None
        if plans:
            self._params = []  # (in _Layers' stacked arrays now)
        self._finalizer = weakref.finalize(self, stop, self._resident)
        if why is not None and not chosen:  # (an algo's own choice is no surprise)
            warnings.warn(f"decoder not resident: {why}; each step runs the "
                          f"{'fused step kernel' if self._fused() else 'GEMM step'}",
                          RuntimeWarning, stacklevel=3)
        if self._layers is not None:  # launched now: the first step finds the weights loaded
            self._layers.ensure()

    def _algo_reason(self, xp) -> str | None:
        """Why the cell's or layer's ``algo`` keeps the decoder from the resident kernel, or
        ``None``: ``"gemm"`` everywhere, ``"auto"`` on NumPy arrays (the emulation is a test
        path: ``"persistent"`` asks for it), as their calls choose."""
        if self.algo == "gemm":
            return "algo='gemm': the GEMM step runs each step"
        if self.algo == "auto" and xp is np:
            return ("NumPy arrays with algo='auto': the GEMM step runs each step "
                    "(algo='persistent' runs the emulated resident kernel, a test path)")
        return None

    def _plans(self, cell: CellSpec, hidden: int, xp) -> tuple[list[DecoderPlan], str | None]:
        """Every layer's resident plan (the first layer's input is x, a further layer's the
        h' below it), or ``([], why not)``."""
        if self.dtype != np.float32:
            return [], f"dtype is {self.dtype.name}: the resident kernel computes float32"
        return plan_layers(cell, hidden, self.batch, _device(xp), self.input_size,
                           len(self._params))

    @property
    def resident(self) -> bool:
        """Whether the steps run on the resident kernel."""
        return self._resident is not None

    @property
    def sms_held(self) -> int:
        """SMs the resident kernel holds while the decoder is open (one CTA per SM: every
        layer's)."""
        return 0 if self._resident is None else self._resident.grid

    @property
    def relaunches(self) -> int:
        """Launches of the resident kernel after its first (each after an idle exit)."""
        return 0 if self._resident is None else self._resident.launches - 1

    @property
    def closed(self) -> bool:
        """Whether ``close()`` (or the end of the ``with`` block) has stopped the decoder."""
        return not self._finalizer.alive

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the resident kernel (each CTA ends within its step) and free the decoder's
        words; later steps raise. Raises what ``check`` raises."""
        resident = self._resident
        self._finalizer()
        try:
            if resident is not None:
                resident.raise_fault()
        finally:
            self._resident, self._layers = None, None

    def _lose(self, exc: DecoderContextLost) -> None:
        """Close the decoder whose context was lost (nothing on the device to stop or free) and
        raise ``exc``."""
        self._lost = str(exc)
        self.close()
        raise exc

    def resume(self) -> None:
        """Relaunch the resident kernel if it has exited (every CTA of every layer idle past its
        deadline). A step does this itself before it enqueues; a replay of a captured loop runs
        no host code, so call ``resume()`` before ``graph.replay()``: without it, steps whose
        resident CTAs are gone still compute, by the step kernel alone (one CTA: much slower)."""
        if self.closed:
            raise RuntimeError("resume() on a closed decoder")
        if self._layers is not None:
            try:
                self._layers.ensure()
            except DecoderContextLost as exc:
                self._lose(exc)

    def check(self) -> None:
        """RuntimeError if a step's wait ran past its deadline (reads the device: synchronises);
        DecoderContextLost if the decoder's context was reset or failed."""
        if self._resident is None:
            return
        try:
            self._resident.ended()
        except DecoderContextLost as exc:
            self._lose(exc)
        self._resident.raise_fault()

    def step(self, x: Array, state: Any = None) -> Any:
        """One step: ``x`` (batch, input_size), projected by the kernels themselves (within
        float32 round-off of the float64 step; not the sequence path's GEMM bits); ``state``
        ``None`` (zeros) or h (a layer: (num_layers, batch, H); a cell: (batch, H)), for LSTM
        ``(h, c)``. Returns a cell's ``h'`` (LSTM ``(h', c')``), a layer's ``(y, h')`` (LSTM
        ``(y, (h', c'))``; y (batch, H) is the last layer's h'). A resident step's outputs are
        fresh arrays, views of one allocation (h' and c' side by side)."""
        hn, cn, _ = self._advance(x, state, None)
        return self._shaped(hn, cn)

    def step_projected(self, gi: Array, state: Any = None) -> Any:
        """``step`` given the first layer's projected input ``gi = x W_ih^T + b_ih`` (batch,
        G*hidden_size) instead of x - e.g. rows of a table projected once per token of a
        vocabulary: the step then skips the kernels' own projection, and is bitwise the
        whole-sequence kernel's step on the same gi. Resident decoders only (ValueError
        otherwise)."""
        hn, cn, _ = self._advance(None, state, gi)
        return self._shaped(hn, cn)

    def _shaped(self, hn: Any, cn: Any) -> Any:
        """A step's result from every layer's h' and c' (``_advance``; arrays, or tensors over
        them: ``TorchDecoder``): a cell's ``h'`` or ``(h', c')``, a layer's ``(y, h')`` or
        ``(y, (h', c'))``."""
        if not self._stacked:
            return (hn, cn) if self._lstm else hn
        return (hn[-1], (hn, cn)) if self._lstm else (hn[-1], hn)

    def _plain(self, a: Any, shape: tuple[int, ...]) -> bool:
        """Whether ``a`` is an array of the decoder's kind, dtype and ``shape``, C-contiguous:
        what a steady-state step passes, accepted by identity and shape checks (anything else
        takes the full checks, which raise or make it so)."""
        return (type(a) is self._array_type and a.dtype == self.dtype and a.shape == shape
                and a.flags.c_contiguous)

    def _advance(self, x: Array | None, state: Any, gi: Array | None,
                 own: bool = False) -> tuple[Any, Any, Array | None]:
        """A step from ``x`` or, for the first layer, its projection ``gi`` (the other
        ``None``): ``(h', c', joint)``, h' and c' every layer's ((num_layers, batch, H) arrays,
        a cell's (batch, H)), ``c'`` ``None`` unless LSTM; ``joint`` the one allocation a
        resident step writes, (2 for LSTM else 1, *state shape), h' and c' its rows (``None``
        for the fallback's separate arrays). ``own``: ``state`` is the state of a resident
        step's result as it was returned (``TorchDecoder`` knows), so its checks passed when it
        was made."""
        if gi is None:
            if not self._plain(x, self._x_shape):
                x = self._checked_input(x)
        elif not self._plain(gi, self._gi_shape) or self._resident is None:
            gi = self._checked_projection(gi)
        h = c = None
        if own:
            h, c = state if self._lstm else (state, None)
        elif self._lstm:
            if type(state) is tuple and len(state) == 2:
                h, c = state
                if not (self._plain(h, self._state_shape) and self._plain(c, self._state_shape)):
                    h = None
        elif self._plain(state, self._state_shape):
            h = state
        layers = self._layers
        if h is None or layers is None or layers.resident.closed:  # (close() leaves none)
            if self.closed:
                raise RuntimeError("step() on a closed decoder" + (
                    f": {self._lost}" if self._lost else ""))
            h, c = self._checked_state(state)
        with self._lock:  # one step at a time through the decoder's mailboxes
            if layers is None:
                hs, cs = (h, c) if self._stacked else ((h,), None if c is None else (c,))
                return (*self._fallback_step(x, hs, cs, gi), None)
            # Every layer's h' and c' written straight into row n of (num_layers, batch, H)
            # outputs (no stacking copy), both in one fresh allocation: the constructor is
            # CuPy's (NumPy's) own, no Python of ``empty``'s
            joint = self._xp.ndarray(self._joint_shape, self.dtype)
            hn, cn = joint[0], joint[1] if self._lstm else None
            try:
                layers.step(x, gi, h, c, hn, cn)
            except DecoderContextLost as exc:
                self._lose(exc)
        return hn, cn, joint

    def _fallback_step(self, x: Array, h: Sequence[Array], c: Sequence[Array] | None,
                       gi: Array | None) -> tuple[Any, Any]:
        """Every layer's step by the fused step kernel (CuPy float32) or the GEMM step."""
        algo = "persistent" if self._fused() else "gemm"
        hs, cs = [], []
        for n, p in enumerate(self._params):
            hn, cn, _, _ = self._fallback(self.cell, p, x if n == 0 else hs[-1], h[n],
                                          None if c is None else c[n], algo)
            hs.append(hn)
            cs.append(cn)
        if not self._stacked:  # (a cell: its arrays as they are, no copy)
            return hs[0], cs[0]
        xp = self._xp
        return xp.stack(hs), xp.stack(cs) if self._lstm else None

    def _checked_projection(self, gi: Array) -> Array:
        if self._resident is None:
            raise ValueError(f"step_projected(): the decoder is not resident ({self.reason})")
        self._check_array("gi", gi)
        if tuple(gi.shape) != self._gi_shape:
            raise ValueError(f"gi must have shape (batch, G*hidden_size) = {self._gi_shape}, "
                             f"got {tuple(gi.shape)}")
        return self._xp.ascontiguousarray(gi)

    def _fused(self) -> bool:
        """Whether a step the resident kernel does not run is the fused step kernel's (CuPy
        float32, unless ``algo="gemm"``), else the GEMM step's."""
        return self._xp is not np and self.dtype == np.float32 and self.algo != "gemm"

    def _checked_input(self, x: Array) -> Array:
        self._check_array("x", x)
        if x.ndim != 2 or x.shape[1] != self.input_size:
            raise ValueError(f"x must have shape (batch, input_size) = ({self.batch}, "
                             f"{self.input_size}), got {tuple(x.shape)}")
        if x.shape[0] != self.batch:
            raise ValueError(f"x has batch size {x.shape[0]}, but the decoder was made for "
                             f"batch={self.batch}")
        return self._xp.ascontiguousarray(x)

    def _checked_state(self, state: Any) -> tuple[Array, Array | None]:
        """The state h and (LSTM) c, checked and C-contiguous; zeros where ``state`` is None."""
        xp, lstm, shape = self._xp, self._lstm, self._state_shape
        h, c = validation.state("state", state, lstm)
        if h is None:
            return xp.zeros(shape, self.dtype), xp.zeros(shape, self.dtype) if lstm else None
        for name, a in ((("state[0]", h), ("state[1]", c)) if lstm else (("state", h),)):
            self._check_array(name, a)
            if tuple(a.shape) != shape:
                dims = "(num_layers, batch, hidden_size)" if self._stacked else "(batch, hidden_size)"
                raise ValueError(f"{name} must have shape {dims} = {shape}, got {tuple(a.shape)}")
        return xp.ascontiguousarray(h), None if c is None else xp.ascontiguousarray(c)

    def _check_array(self, name: str, a: Array) -> None:
        if validation.common_module(**{name: a}) is not self._xp:
            where = "the CPU (NumPy)" if self._xp is np else "the GPU (CuPy)"
            raise TypeError(f"{name} must be on the decoder's device, {where}, got "
                            f"{type(a).__module__}.{type(a).__name__}")
        if a.dtype != self.dtype:
            raise TypeError(f"{name} must have dtype {self.dtype.name} (the decoder's), got "
                            f"{np.dtype(a.dtype).name}")


def _device(xp) -> hardware.DeviceProfile:
    from .runtime import planning_device
    return planning_device(xp is not np)
