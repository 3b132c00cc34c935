"""@nki.jit with numpy / torch (fp32, bf16) arguments, in-place outputs, grid launches, simulate, loops."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from trnkit import nkisim as nki
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import memory, trace
from trnkit.nkisim.errors import NkiValidationError

RNG = np.random.default_rng(3)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _add_tiles(a, b, out, rows):
    """out[rows] = a[rows] + b[rows], 128-row tiles."""
    for r0 in range(rows.start, rows.stop, 128):
        ta = nl.ndarray((128, a.shape[1]), a.dtype, buffer=nl.sbuf)
        tb = nl.ndarray((128, a.shape[1]), b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ta, src=a[r0:r0 + 128, :])
        nisa.dma_copy(dst=tb, src=b[r0:r0 + 128, :])
        tc = nl.ndarray((128, a.shape[1]), out.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=tc, data1=ta, data2=tb, op=nl.add)
        nisa.dma_copy(dst=out[r0:r0 + 128, :], src=tc)


@nki.jit
def add_kernel(a, b):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    _add_tiles(a, b, out, range(0, a.shape[0]))
    return out


@nki.jit
def add_into(a, b, out):
    _add_tiles(a, b, out, range(0, a.shape[0]))
    return out


@nki.jit
def add_spmd(a, b):
    """Each program adds its half of the rows into one shared output."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    n = nl.num_programs(0)
    half = a.shape[0] // n
    pid = nl.program_id(0)
    _add_tiles(a, b, out, range(pid * half, (pid + 1) * half))
    return out


def test_numpy_args_return_numpy():
    a = RNG.standard_normal((256, 64)).astype(np.float32)
    b = RNG.standard_normal((256, 64)).astype(np.float32)
    out = add_kernel(a, b)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, a + b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_args_return_torch_same_dtype(dtype):
    a = torch.randn(128, 32, dtype=dtype)
    b = torch.randn(128, 32, dtype=dtype)
    out = add_kernel(a, b)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    ref = (a.float() + b.float()).to(dtype)  # fp32 arithmetic, one RNE rounding
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["numpy", "torch_f32", "torch_bf16"])
def test_preallocated_output_written_in_place(kind):
    a = RNG.standard_normal((128, 16)).astype(np.float32)
    b = RNG.standard_normal((128, 16)).astype(np.float32)
    if kind == "numpy":
        out = np.zeros_like(a)
        ret = add_into(a, b, out)
        np.testing.assert_array_equal(out, a + b)
    else:
        dt = torch.float32 if kind == "torch_f32" else torch.bfloat16
        ta, tb = torch.from_numpy(a).to(dt), torch.from_numpy(b).to(dt)
        out = torch.zeros(128, 16, dtype=dt, requires_grad=False)
        ret = add_into(ta, tb, out)
        torch.testing.assert_close(out, (ta.float() + tb.float()).to(dt), rtol=0, atol=0)
    assert ret is out  # a returned argument comes back as the caller's object


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_args_stay_resizable(dtype):
    """FSDP2 frees unsharded parameters with storage.resize_(0) after they went through a kernel;
    handing a tensor to the interpreter must not mark its storage non-resizable (Tensor.numpy() does)."""
    a, b = torch.randn(128, 16, dtype=dtype), torch.randn(128, 16, dtype=dtype)
    out = torch.zeros(128, 16, dtype=dtype)
    add_into(a, b, out)
    torch.testing.assert_close(out, (a.float() + b.float()).to(dtype), rtol=0, atol=0)
    for t in (a, b, out):
        t.untyped_storage().resize_(0)
        assert t.untyped_storage().nbytes() == 0


def test_non_contiguous_torch_output_is_copied_back():
    a = torch.randn(128, 16)
    b = torch.randn(128, 16)
    base = torch.zeros(16, 128)
    out = base.t()  # non-contiguous view
    add_into(a, b, out)
    torch.testing.assert_close(base.t(), a + b, rtol=0, atol=0)


def test_grid_launch_two_programs_share_hbm():
    a = RNG.standard_normal((256, 32)).astype(np.float32)
    b = RNG.standard_normal((256, 32)).astype(np.float32)
    seen = []

    @nki.jit
    def probe(x):
        seen.append((nl.program_id(0), nl.num_programs(0), nl.program_ndim(),
                     memory.current().launch.num_instances))
        return x

    probe[2](a)
    assert sorted(seen) == [(0, 2, 1, 2), (1, 2, 1, 2)]
    with trace.record() as tr:
        out = add_spmd[2](a, b)
    np.testing.assert_array_equal(out, a + b)  # both halves land in the one shared output
    assert {i.program_id for i in tr} == {0, 1}
    np.testing.assert_array_equal(nki.simulate(add_spmd[2])(a, b), a + b)
    np.testing.assert_array_equal(add_spmd(a, b), a + b)  # 1 program does all rows


def test_2d_grid_program_ids():
    ids = []

    @nki.jit
    def probe(x):
        ids.append((nl.program_id(0), nl.program_id(1), nl.num_programs(None), nl.num_programs(1),
                    nl.num_programs(), nl.num_programs((0, 1))))

    probe[2, 3](np.zeros(4, np.float32))
    assert sorted(ids) == [(i, j, 6, 3, 2, 6) for i in range(2) for j in range(3)]


def test_no_grid_program_id_defaults():
    got = []

    @nki.jit
    def probe(x):
        got.append((nl.program_id(), nl.num_programs(), nl.program_ndim()))

    probe(np.zeros(4, np.float32))
    assert got == [(0, 1, 0)]


def test_simulate_plain_function_and_jit_kernel():
    a = RNG.standard_normal((128, 8)).astype(np.float32)

    def plain(x, y):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        _add_tiles(x, y, out, range(0, x.shape[0]))
        return out

    np.testing.assert_array_equal(nki.simulate(plain)(a, a), 2 * a)
    np.testing.assert_array_equal(nki.simulate(add_kernel)(a, a), 2 * a)


def test_error_in_a_program_is_raised_with_its_id():
    @nki.jit
    def bad(x):
        if nl.program_id(0) == 1:
            nl.ndarray((129, 4), nl.float32, buffer=nl.sbuf)
        return x

    with pytest.raises(NkiValidationError, match="partition dim 129 exceeds pmax") as e:
        bad[2](np.zeros(4, np.float32))
    assert any("program (1,)" in n for n in getattr(e.value, "__notes__", []))


def test_return_rules_and_argument_dtypes():
    @nki.jit
    def ret_sbuf(x):
        return nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)

    @nki.jit
    def ret_private(x):
        return nl.ndarray((4, 4), nl.float32, buffer=nl.hbm)

    x = np.zeros((4, 4), np.float32)
    with pytest.raises(NkiValidationError, match="returned on-chip tensor"):
        ret_sbuf(x)
    with pytest.raises(NkiValidationError, match="outputs must be allocated in nl.shared_hbm"):
        ret_private(x)
    with pytest.raises(NkiValidationError, match="float64 is not an NKI dtype"):
        add_kernel(np.zeros((128, 4)), np.zeros((128, 4)))
    with pytest.raises(NkiValidationError, match="torch dtype torch.int64, not an NKI dtype"):
        add_kernel(torch.zeros(128, 4, dtype=torch.int64), torch.zeros(128, 4, dtype=torch.int64))


def test_each_call_starts_with_empty_on_chip_memory():
    outer = nl.ndarray((128, 100 * 1024 // 4), nl.float32, buffer=nl.sbuf)  # outside: not counted
    nisa.memset(dst=outer, value=0.0)
    contexts = []

    @nki.jit
    def k(x):
        contexts.append(memory.current())
        t = nl.ndarray((128, 200 * 1024 // 4), nl.float32, buffer=nl.sbuf)  # 200 KiB fits anew
        nisa.memset(dst=t, value=0.0)
        nisa.tensor_copy(dst=t[:, 0:1], src=t[:, 1:2])
        return x

    k(np.zeros(4, np.float32))
    k(np.zeros(4, np.float32))
    assert contexts[0] is not contexts[1]
    assert [c.memory.sbuf_peak for c in contexts] == [200 * 1024, 200 * 1024]
    assert [c.memory.clock for c in contexts] == [2, 2]  # memset, tensor_copy


def test_fori_loop_register_scalar_offset():
    # nl.fori_loop: body gets a VirtualRegister, used as .ap(scalar_offset=i)
    table = RNG.standard_normal((6, 128, 16)).astype(np.float32)

    @nki.jit
    def sum_blocks(x, n_blocks):
        acc = nl.ndarray((128, 16), nl.float32, buffer=nl.sbuf)
        nisa.memset(acc, 0.0)
        ub = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ub, src=n_blocks)
        reg = nisa.register_alloc()
        nisa.register_load(reg, ub)

        def body(i):
            t = nl.ndarray((128, 16), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x.ap([[16, 128], [1, 16]], offset=0, scalar_offset=i,
                                          indirect_dim=0))
            nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)

        nl.fori_loop(1, reg, body)
        out = nl.ndarray((128, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out

    out = sum_blocks(table, np.array([[5]], np.int32))
    np.testing.assert_allclose(out, table[1:5].sum(0), rtol=1e-6, atol=1e-6)
    calls = []
    nl.fori_loop(0, 7, lambda i: calls.append(i.value), step=3)
    assert calls == [0, 3, 6]


def test_loop_aliases_and_tile_size():
    assert list(nl.affine_range(3)) == list(nl.sequential_range(3)) == list(nl.static_range(3)) == [0, 1, 2]
    ts = nl.tile_size
    assert (ts.pmax, ts.psum_fmax, ts.gemm_stationary_fmax, ts.gemm_moving_fmax) == (128, 512, 128, 512)
    assert nl.ds(4, 8) == slice(4, 12)


def test_lnc2_core_barrier_and_sendrecv():
    a = RNG.standard_normal((256, 16)).astype(np.float32)

    @nki.jit
    def exchange(x):
        """Each core loads its half, swaps it with the other core, writes the swapped halves."""
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        pid = nl.program_id(0)
        mine = nl.ndarray((128, 16), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=mine, src=x[pid * 128:(pid + 1) * 128, :])
        theirs = nl.ndarray((128, 16), nl.float32, buffer=nl.sbuf)
        other = 1 - pid
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=other, recv_from_rank=other, pipe_id=0)
        nisa.dma_copy(dst=out[pid * 128:(pid + 1) * 128, :], src=theirs)
        nisa.core_barrier(out, (0, 1))
        # after the barrier both halves are written: read back the other core's half
        check = nl.ndarray((128, 16), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=check, src=out[other * 128:(other + 1) * 128, :])
        return out

    out = exchange[2](a)
    np.testing.assert_array_equal(out, np.concatenate([a[128:], a[:128]]))
    with pytest.raises(NkiValidationError, match="needs an LNC=2 launch"):
        exchange(a)


def test_core_barrier_on_sbuf_data_and_rules():
    # bwmm_shard_on_I (nki-library, AWS-tested) synchronises on an SBUF block counter
    @nki.jit
    def count(x, buffer):
        out = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.shared_hbm)
        counter = nl.ndarray((1, 1), nl.int32, buffer=buffer)
        nisa.memset(counter, 0)
        for _ in range(3):
            nisa.tensor_scalar(dst=counter, data=counter, op0=nl.add, operand0=1)
            nisa.core_barrier(counter, (0, 1))
        pid = nl.program_id(0)
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=counter)
        return out

    np.testing.assert_array_equal(count[2](np.zeros(1, np.float32), nl.sbuf), [[3], [3]])
    with pytest.raises(NkiValidationError, match=r"core_barrier: data must be in shared_hbm \(or "
                                                 r"SBUF\), got psum"):
        count[2](np.zeros(1, np.float32), nl.psum)


def test_a_shared_hbm_buffer_is_held_by_the_programs_not_the_launch():
    """The k-th shared_hbm allocation is one storage for both programs; once both have it, the launch lets go
    of it, so a kernel that allocates a shared buffer per block does not keep every block's to the end."""
    held = []

    @nki.jit
    def per_block(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        pid = nl.program_id(0)
        for block in range(3):
            scratch = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray((64, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x[pid * 64:(pid + 1) * 64, :])
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(block))
            nisa.dma_copy(dst=scratch[pid * 64:(pid + 1) * 64, :], src=t)
            nisa.core_barrier(scratch, (0, 1))  # each program reads the other's half
            nisa.dma_copy(dst=t, src=scratch[(1 - pid) * 64:(2 - pid) * 64, :])
            nisa.dma_copy(dst=out[pid * 64:(pid + 1) * 64, :], src=t)
            nisa.core_barrier(scratch, (0, 1))
        held.append(list(memory.current().launch.shared))
        return out

    x = np.arange(128 * 4, dtype=np.float32).reshape(128, 4)
    np.testing.assert_array_equal(per_block[2](x), np.concatenate([x[64:], x[:64]]) + 2.0)
    assert held == [[None] * 4, [None] * 4]  # out and the three scratch buffers: both programs had them


@nki.jit
def _scaled_tile_in_sbuf(x, scale):
    """A decorated sub-kernel returning an on-chip tile (nki-library's qkv with its output in SBUF)."""
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out, data=t, op0=nl.multiply, operand0=scale)
    return out, nl.program_id(0), nl.num_programs(0)


@nki.jit
def _calls_decorated_subkernel(x):
    """Each program scales its half by (its program id + 2) through the decorated sub-kernel."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    pid, n = nl.program_id(0), nl.num_programs(0)
    half = x.shape[0] // n
    rows = slice(pid * half, (pid + 1) * half)
    tile, sub_pid, sub_n = _scaled_tile_in_sbuf(x[rows, :], float(pid + 2))
    assert (sub_pid, sub_n) == (pid, n)  # the sub-kernel runs in the caller's program
    nisa.dma_copy(dst=out[rows, :], src=tile)
    return out


@pytest.mark.parametrize("lnc", [1, 2])
def test_decorated_subkernel_is_inlined_into_the_calling_program(lnc):
    """A @nki.jit kernel called inside a kernel is inlined (the compiler inlines every call): it may
    return an SBUF tile and sees the caller's program id and count (AWS's attention_block_tkg calls the
    decorated qkv with its output in SBUF)."""
    x = RNG.standard_normal((128, 32)).astype(np.float32)
    out = nki.simulate(_calls_decorated_subkernel)[lnc](x)
    half = 128 // lnc
    expected = np.concatenate([x[p * half:(p + 1) * half] * (p + 2) for p in range(lnc)])
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_a_top_level_kernel_still_may_not_return_sbuf():
    with pytest.raises(NkiValidationError, match="on-chip tensor"):
        _scaled_tile_in_sbuf(RNG.standard_normal((128, 8)).astype(np.float32), 2.0)


@pytest.mark.parametrize("lnc, fails", [(1, False), (2, False), (2, True)])
def test_a_launch_keeps_none_of_its_memory_once_it_returns(lnc, fails):
    """The held-out calibration traces hundreds of nki-library rows in one process: once a launch has returned
    (or raised, and its exception is gone), nothing of its kernel instances is alive, even while the trace it
    recorded is: their contexts, liveness records, placed SBUF bytes and tiles' data are freed (the trace
    holds numbers and storage keys only)."""
    import gc
    import weakref

    refs = []

    @nki.jit
    def kernel(x, fail):
        ctx = memory.current()
        a = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf, address=(0, 0))  # the instance's placed bytes
        b = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        nisa.tensor_copy(dst=b, src=a)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=b)
        refs.extend(weakref.ref(o) for o in (ctx, ctx.memory, ctx.launch, *ctx.placed.values(), a.storage.data,
                                             b.storage.data, out.storage.data))
        if fail:
            raise ValueError("the kernel stops here")
        return out

    x = RNG.standard_normal((128, 512)).astype(np.float32)
    with trace.record() as tr:
        if fails:
            with pytest.raises(ValueError, match="the kernel stops here"):
                kernel[lnc](x, fails)
        else:
            np.testing.assert_array_equal(kernel[lnc](x, fails), x)
    gc.collect()
    # (a failing program stops the other at its next instruction: it may not reach the end)
    assert len(refs) == 7 * lnc if not fails else len(refs) in (7, 14)
    assert len(tr) >= 3 * (len(refs) // 7)
    assert [r for r in refs if r() is not None] == []


@nki.jit
def _copy_rows(x, rows=(0, 1)):
    out = nl.ndarray((len(rows), x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    for i, r in enumerate(rows):
        t = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r:r + 1, :])
        nisa.dma_copy(dst=out[i:i + 1, :], src=t)
    return out


def test_a_list_kernel_argument_is_refused_at_the_launch_and_a_tuple_runs():
    """NKI 0.2 -> 0.3 migration guide, "Replace list kernel arguments with tuples": "The NKI 0.3.0 compiler does
    not support list as a kernel argument type"; a list inside a running kernel (an inlined call) is Python."""
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(_copy_rows(x, rows=(2, 3)), x[2:4])
    for call in (lambda: _copy_rows(x, rows=[2, 3]), lambda: _copy_rows(x, [2, 3]),
                 lambda: _copy_rows[2](x, rows=[2, 3])):
        with pytest.raises(NkiValidationError, match=r"nki.jit: kernel _copy_rows argument 'rows' is a list "
                           r"\(\[2, 3\]\): the compiler does not support list as a kernel argument type; pass a "
                           r"tuple \(NKI 0.2 -> 0.3 migration guide"):
            call()

    @nki.jit
    def outer(x):
        return _copy_rows(x, rows=[1])  # inlined: its caller's program

    np.testing.assert_array_equal(outer(x), x[1:2])


def test_a_keyword_only_separator_in_a_kernel_signature_is_refused():
    """NKI 0.2 -> 0.3 migration guide, "Remove keyword-only argument separator (*)": "The NKI 0.3.0 compiler
    does not support the * separator in kernel function signatures"."""
    @nki.jit
    def scaled(x, *, flag=True):
        return x

    x = np.zeros((4, 8), np.float32)
    with pytest.raises(NkiValidationError, match=r"nki.jit: kernel scaled has keyword-only parameters \('flag',\) "
                       r"\(after a '\*' separator\): the compiler does not support the '\*' separator"):
        scaled(x)
