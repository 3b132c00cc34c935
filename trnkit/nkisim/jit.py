"""``@nki.jit``, grid launch ``kernel[g](...)`` and ``nki.simulate`` for the interpreter.

A kernel call wraps every numpy array / CPU torch tensor argument as an HBM :class:`NkiTensor`
aliasing the caller's memory (zero copy when contiguous; bf16 torch tensors through an int16 view),
so HBM tensors the kernel writes are updated in place ("Input arrays are updated in-place if the
kernel modified the corresponding HBM tensors", ``nki/guides/nki_simulator.rst``) and preallocated
outputs work. Returned tensors come back as numpy arrays, or torch tensors when any argument was a
torch tensor; a returned argument comes back as the caller's own object. Each program instance runs
with a fresh :class:`~trnkit.nkisim.memory.KernelContext` (empty SBUF/PSUM); a grid launch runs one
Python thread per instance, all sharing the arguments and the launch's ``shared_hbm`` allocations,
like the official simulator's LNC=2 mode; the threads take turns, one instruction each, as cores
started together issue them (:class:`~trnkit.nkisim.controlflow.Turnstile`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import blas as _blas
from . import controlflow as _cf
from . import dtypes as _dt
from . import memory as _mem
from . import ops as _ops
from . import trace as _trace
from .errors import fail, require
from .tensor import NkiTensor, from_array, hbm, shared_hbm

__all__ = ["jit", "simulate", "Kernel", "to_numpy", "from_numpy"]

try:  # torch is a base dependency of trnkit, but keep the interpreter importable without it
    import torch
except ImportError:  # pragma: no cover
    torch = None

_TORCH_TO_NP: dict[Any, np.dtype] = {}
_NP_TO_TORCH: dict[np.dtype, Any] = {}
if torch is not None:
    _pairs = [(torch.float32, _dt.float32), (torch.float16, _dt.float16),
              (torch.bfloat16, _dt.bfloat16), (torch.int8, _dt.int8), (torch.int16, _dt.int16),
              (torch.int32, _dt.int32), (torch.uint8, _dt.uint8), (torch.bool, _dt.bool_),
              (torch.float8_e4m3fn, _dt.float8_e4m3fn), (torch.float8_e5m2, _dt.float8_e5m2)]
    for _t, _n in _pairs:
        _TORCH_TO_NP[_t] = _n
        _NP_TO_TORCH[_n] = _t
    for _t, _n in ((getattr(torch, "uint16", None), _dt.uint16), (getattr(torch, "uint32", None), _dt.uint32)):
        if _t is not None:
            _TORCH_TO_NP[_t] = _n
            _NP_TO_TORCH[_n] = _t


def to_numpy(t: Any, name: str = "tensor") -> np.ndarray:
    """A numpy array sharing memory with CPU torch tensor ``t`` (bf16/fp8 via same-size int views)."""
    require(t.device.type == "cpu", "nki.jit", "argument {name!r} is on {device}; the interpreter "
            "runs on CPU tensors", name=name, device=str(t.device))
    dt = _TORCH_TO_NP.get(t.dtype)
    require(dt is not None, "nki.jit", "argument {name!r} has torch dtype {dtype}, not an NKI dtype",
            name=name, dtype=str(t.dtype))
    # DLPack, not Tensor.numpy(): .numpy() marks the storage non-resizable for good, which breaks
    # FSDP2's reshard (storage.resize_(0)) of parameters that went through a kernel.
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        return np.from_dlpack(t.view(torch.int16)).view(dt)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return np.from_dlpack(t.view(torch.uint8)).view(dt)
    return np.from_dlpack(t)


def from_numpy(a: np.ndarray) -> Any:
    """A CPU torch tensor sharing memory with numpy array ``a`` (inverse of :func:`to_numpy`)."""
    a = np.ascontiguousarray(a)
    tdt = _NP_TO_TORCH.get(a.dtype)
    require(tdt is not None, "nki.jit", "result dtype {dtype} has no torch equivalent", dtype=a.dtype.name)
    if a.dtype in (_dt.bfloat16, _dt.float16):
        return torch.from_numpy(a.view(np.int16)).view(tdt)
    if a.dtype in (_dt.float8_e4m3fn, _dt.float8_e5m2):
        return torch.from_numpy(a.view(np.uint8)).view(tdt)
    return torch.from_numpy(a)


class _Args:
    """Converts a call's arguments to HBM tensors and writes back non-contiguous ones afterwards."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.uses_torch = False
        self.by_storage: dict[int, Any] = {}  # id(Storage) -> (original object, root tensor)
        self.copy_back: list[tuple[Any, np.ndarray]] = []

    def wrap(self, value: Any, name: str) -> Any:
        if isinstance(value, np.ndarray):
            return self._wrap_array(value, value, name)
        if torch is not None and isinstance(value, torch.Tensor):
            self.uses_torch = True
            return self._wrap_array(value, to_numpy(value, name), name)
        if isinstance(value, tuple):
            return tuple(self.wrap(v, f"{name}[{i}]") for i, v in enumerate(value))
        if isinstance(value, list):
            return [self.wrap(v, f"{name}[{i}]") for i, v in enumerate(value)]
        return value

    def _wrap_array(self, original: Any, arr: np.ndarray, name: str) -> NkiTensor:
        require(arr.ndim >= 1, "nki.jit", "argument {name!r} is 0-d; pass at least a 1-D array",
                name=name)
        _dt.resolve(arr.dtype, f"nki.jit argument {name!r}")
        if not arr.flags.c_contiguous:
            contiguous = np.ascontiguousarray(arr)
            self.copy_back.append((original, contiguous))
            arr = contiguous
        t = from_array(arr, self.buffer, name)
        self.by_storage[id(t.storage)] = (original, t)
        return t

    def finish(self) -> None:
        for original, arr in self.copy_back:
            if isinstance(original, np.ndarray):
                original[...] = arr
            else:
                original.copy_(from_numpy(arr))

    def result(self, value: Any) -> Any:
        if isinstance(value, NkiTensor):
            hit = self.by_storage.get(id(value.storage))
            if hit is not None and value.shape == hit[1].shape and value.offset == 0 \
                    and value.strides == hit[1].strides and value.dtype == hit[1].dtype:
                return hit[0]
            require(not value.on_chip, "nki.jit", "kernel returned on-chip tensor {name!r} "
                    "({buffer}); return HBM tensors (nl.shared_hbm)", name=value.name,
                    buffer=value.buffer.name)
            if hit is None:
                require(value.buffer is shared_hbm, "nki.jit", "kernel returned tensor {name!r} "
                        "in {buffer}; kernel outputs must be allocated in nl.shared_hbm",
                        name=value.name, buffer=value.buffer.name)
            out = value.np()
            out = out if hit is None and value.offset == 0 and out.flags.c_contiguous else out.copy()
            return from_numpy(out) if self.uses_torch else out
        if isinstance(value, tuple):
            return tuple(self.result(v) for v in value)
        if isinstance(value, list):
            return [self.result(v) for v in value]
        if isinstance(value, dict):
            return {k: self.result(v) for k, v in value.items()}
        return value


class Kernel:
    """A ``@nki.jit`` kernel: call it directly, or ``kernel[grid](...)`` for an SPMD launch. ``rules``: what its
    launches run under (:class:`~trnkit.nkisim.memory.LaunchRules`, set by :func:`simulate`); ``options``: the
    ``@nki.jit(...)`` options (accepted, unused)."""

    def __init__(self, fn: Callable[..., Any], grid: tuple[int, ...] = (), rules: _mem.LaunchRules | None = None,
                 **options: Any) -> None:
        self.fn = fn
        self.grid = grid
        self.rules = rules if rules is not None else _mem.LaunchRules()
        self.options = options
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: int | tuple[int, ...]) -> Kernel:
        g = grid if isinstance(grid, tuple) else (grid,)
        for n in g:
            require(isinstance(n, (int, np.integer)) and n >= 1, "nki.jit", "grid dims must be "
                    "positive ints, got {grid}", grid=grid)
        return Kernel(self.fn, tuple(int(n) for n in g), self.rules, **self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.grid and _mem.running() is not None:
            # Called inside a running kernel: the compiler inlines every call ("Specialization ... inlines
            # every call", NKI language guide), so the body runs in the caller's program, with its
            # program ids, memory, rules and control flow, and returns what it returns (on-chip tiles
            # included). The 0.2.0 migration guide says sub-kernels should not carry @nki.jit, but AWS's
            # tested kernels call decorated ones (nki-library's attention_block_tkg calls qkv with
            # its output in SBUF): the tested kernel wins.
            return self.fn(*args, **kwargs)
        return _launch(self.fn, self.grid, args, kwargs, self.rules, recording=_trace.recording())

    def __repr__(self) -> str:
        return f"<nki.jit kernel {self.fn.__name__} grid={self.grid}>"


_LANGUAGE_RESTRICTIONS = ("NKI 0.2 -> 0.3 migration guide, \"Language restrictions\"; NKI 0.3.0 release notes: "
                          "\"{what} ... not supported\"")


def _check_kernel_arguments(fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """The NKI 0.3.0 compiler's rules on a launched kernel's signature and arguments (0.2 -> 0.3 migration
    guide, "Language restrictions"): no keyword-only ``*`` separator ("The NKI 0.3.0 compiler does not support
    the ``*`` separator in kernel function signatures"), no ``list`` argument ("does not support ``list`` as a
    kernel argument type. Convert list arguments to tuples at the call site"). Only the launched function is
    checked: a call inside a running kernel is inlined (lists and ``*`` work there, as in Python)."""
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_kwonlyargcount:
        kwonly = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
        fail("nki.jit", "kernel {kernel} has keyword-only parameters {params} (after a '*' separator): the "
             "compiler does not support the '*' separator in kernel signatures; move the parameters with "
             "defaults to the end instead ({doc})", kernel=fn.__name__, params=kwonly,
             doc=_LANGUAGE_RESTRICTIONS.format(what="Keyword-only argument separator (*) in kernel signatures is"))
    names = code.co_varnames[:code.co_argcount] if code is not None else ()
    given = [(names[i] if i < len(names) else f"arg{i}", v) for i, v in enumerate(args)] + list(kwargs.items())
    for name, v in given:
        if isinstance(v, list):
            fail("nki.jit", "kernel {kernel} argument {arg!r} is a list ({value}): the compiler does not "
                 "support list as a kernel argument type; pass a tuple ({doc})", kernel=getattr(fn, "__name__", fn),
                 arg=name, value=_short(v), doc=_LANGUAGE_RESTRICTIONS.format(what="list kernel arguments are"))


def _short(v: list) -> str:
    text = repr(v) if all(not isinstance(x, (np.ndarray, NkiTensor)) for x in v) else f"{len(v)} items"
    return text if len(text) <= 60 else text[:57] + "..."


def _launch(fn: Callable[..., Any], grid: tuple[int, ...], args: tuple, kwargs: dict,
            rules: _mem.LaunchRules = _mem.LaunchRules(), rank: Any = None,
            recording: _trace.Trace | None = None) -> Any:
    """Run ``fn`` as one program per grid point, each under ``rules`` (:class:`~trnkit.nkisim.memory.LaunchRules`),
    on device ``rank`` of a multi-rank run (``collectives.run_ranks``; None: a lone device), its instructions
    recorded in ``recording`` (the ``trace.record`` block open where the launch was made; one opened with
    ``trace_only=True`` makes the launch trace-only). A launch made inside a running kernel is part of that
    kernel and runs under its rules, on its device, recorded in its trace, instead."""
    caller = _mem.running()
    if caller is None:  # a top-level launch: the compiler's kernel-signature rules
        _check_kernel_arguments(fn, args, kwargs)
    if caller is not None:
        rules, rank, recording = caller.rules, caller.launch.rank, caller.launch.trace
    elif recording is not None and recording.trace_only and not rules.trace_only:
        rules = dataclasses.replace(rules, trace_only=True)
    n = math.prod(grid) if grid else 1
    conv = _Args(shared_hbm if n > 1 else hbm)
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    wargs = tuple(conv.wrap(a, names[i] if i < len(names) else f"arg{i}") for i, a in enumerate(args))
    wkwargs = {k: conv.wrap(v, k) for k, v in kwargs.items()}
    launch = _mem.LaunchContext(grid=grid, barrier=_cf.Rendezvous(n) if n > 1 else None, rank=rank,
                                trace=recording)
    ids = list(itertools.product(*(range(g) for g in grid))) if grid else [()]
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    # a one-program launch inside a kernel is part of its caller's program (control-flow record)
    outer = caller.program if caller is not None else None
    programs = [outer if outer is not None and n == 1 else _cf.Program(i, rules.strict) for i in range(n)]
    # several programs run as concurrent cores do: in lockstep, one instruction each in turn
    turnstile = None
    if n > 1:
        turnstile = _cf.Turnstile(n)
        for p in programs:
            p.turnstile = turnstile

    def run(i: int) -> None:
        if turnstile is not None:
            turnstile.start(i)
        ctx = _mem.KernelContext(program_id=ids[i], launch=launch, flat_program_id=i, rules=rules,
                                 program=programs[i])
        _mem.push_context(ctx)
        try:
            with _ops.fp_errors_ignored():  # the hardware's inf/nan are silent
                results[i] = fn(*wargs, **wkwargs)
            ctx.memory.check(rules.capacity)  # SBUF/PSUM capacity over data liveness
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            errors[i] = exc
            if launch.barrier is not None:
                launch.barrier.abort()  # do not leave the other programs waiting
        finally:
            _mem.pop_context()
            if launch.barrier is not None:  # nor waiting at a barrier this program never reaches
                launch.barrier.finish()  # (different control flow: reported by _cf.compare below)
            if turnstile is not None:  # the next program's turn; after a failure the others stop
                turnstile.finish(i, failed=errors[i] is not None
                                 and not isinstance(errors[i], threading.BrokenBarrierError))

    with _blas.launch_threads():  # small matmuls: one BLAS thread (see blas.py)
        if n == 1:
            run(0)
        else:
            threads = [threading.Thread(target=run, args=(i,), name=f"nki-program-{i}") for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    for i, exc in enumerate(errors):
        if exc is not None and not isinstance(exc, threading.BrokenBarrierError):
            if n > 1 and hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"(in program {ids[i]} of grid {grid})")
            raise exc
    if n == 2:  # an LNC=2 launch: both programs must take the same runtime control flow
        _cf.compare(programs)
    for exc in errors:
        if exc is not None:
            raise exc
    conv.finish()
    return conv.result(results[0])


def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``@nki.jit`` / ``@nki.jit(...)``: make ``fn`` a :class:`Kernel` (options are accepted, unused)."""
    if fn is None:
        return lambda f: Kernel(f, **options)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, **options)


def simulate(kernel: Any, strict: bool = True, capacity: str = "checked", placement: bool = True,
             trace_only: bool = False) -> Kernel:
    """``nki.simulate(kernel)(*args)``: run ``kernel`` (jit, grid-indexed, or plain function) here.

    The other arguments are trnkit extensions, the rules every launch of the returned kernel runs under
    (:class:`~trnkit.nkisim.memory.LaunchRules` says why each exists): ``strict=False`` reports undefined
    behaviour on the hardware as :class:`~trnkit.nkisim.controlflow.UndefinedBehaviourWarning` instead of
    raising (invalid uses still raise); ``capacity`` is ``"checked"`` (SBUF or PSUM overflow raises),
    ``"sbuf_spills"`` (SBUF beyond capacity is warned about, :class:`~trnkit.nkisim.memory.SbufSpillWarning`,
    as neuronx-cc's allocator spills it; PSUM stays checked) or ``"unchecked"`` (the peaks are only measured);
    ``placement=False`` gives each ``nl.ndarray(..., address=)`` tile storage of its own (a diagnostic);
    ``trace_only=True`` skips the arithmetic of large matmuls (a launch for the cost model's trace, its outputs
    not meaningful)."""
    rules = _mem.LaunchRules(strict, capacity, placement, trace_only)
    if isinstance(kernel, Kernel):
        return Kernel(kernel.fn, kernel.grid, rules, **kernel.options)
    if callable(kernel):
        return Kernel(kernel, rules=rules)
    fail("nki.simulate", "expected a kernel function, got {type}", type=type(kernel).__name__)
