"""Chunked linear cross-entropy vs the unfused lm_head + F.cross_entropy (loss and both gradients).

fp32 tolerance: the chunked loss sums per-chunk partial sums and forms dW as a sum of per-chunk
matmuls, so it differs from the unfused result by summation order only: rtol 1e-5, atol 1e-5
(tests/tolerances.py). bf16 (autocast): both paths form the logits in bf16 and the softmax in fp32,
rounding at different points; the chunked result must be as close to the exact one as the unfused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.tolerances import assert_close
from trnkit.qwen3 import Qwen3Model, model_registry
from trnkit.qwen3 import loss as loss_module
from trnkit.qwen3.loss import linear_cross_entropy


def _reference(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.T).float().flatten(0, -2), y.flatten(), ignore_index=-100, reduction="sum")


def _grads(fn, h, w, y):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = fn(h, w, y)
    (loss * 0.37).backward()  # a non-unit upstream gradient: the stored grads must be scaled
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("shape, vocab, chunk", [
    ((2, 7), 50, 3),        # chunks that do not divide the tokens
    ((1, 16), 33, 16),      # one chunk exactly
    ((3, 5), 17, 1024),     # chunk larger than the tokens
    ((4,), 8, 1),           # one token per chunk, flat leading shape
])
def test_matches_unfused_fp32(shape: tuple[int, ...], vocab: int, chunk: int) -> None:
    g = torch.Generator().manual_seed(sum(shape) + vocab)
    h = torch.randn(*shape, 12, generator=g)
    w = torch.randn(vocab, 12, generator=g) * 0.5
    y = torch.randint(0, vocab, shape, generator=g)
    y.view(-1)[::3] = -100  # ignored tokens contribute neither loss nor gradient
    ref = _grads(_reference, h, w, y)
    got = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, chunk_size=chunk), h, w, y)
    for a, e, name in zip(got, ref, ("loss", "dh", "dw")):
        assert_close(a, e, torch.float32, msg=name)
    assert torch.all(got[1].view(-1, 12)[::3] == 0)  # ignored rows get exactly zero dh


@pytest.mark.parametrize("matmul", ["bf16", "fp32"])
def test_bf16_autocast_as_accurate_as_unfused(matmul: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under autocast both paths round the logits and the logit gradients to bf16, at different points
    # (the chunked dW sums fp32 per-chunk products): compare both with the exact (fp64) result for the
    # same bf16-rounded inputs. Error bound: 2**-7 of the largest magnitude (one bf16 ulp at the top).
    # Both ways of multiplying the bf16 operands: bf16 matmuls (a CPU with native bf16 matmul, or a
    # GPU) and fp32 matmuls of the rounded operands (a CPU without), whichever this machine has.
    monkeypatch.setattr(loss_module, "matmul_dtype",
                        lambda dt, device: torch.float32 if matmul == "fp32" else dt)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(3, 10, 32, generator=g), torch.randn(64, 32, generator=g) * 0.2
    y = torch.randint(0, 64, (3, 10), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unfused = _grads(_reference, h, w, y)
        chunked = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, chunk_size=7), h, w, y)
    exact = _grads(_reference, h.bfloat16().double(), w.bfloat16().double(), y)
    assert chunked[0].dtype == torch.float32
    for c, u, x, name in zip(chunked, unfused, exact, ("loss", "dh", "dw")):
        scale = float(x.abs().max())
        err_c, err_u = (float((t.double() - x).abs().max()) / scale for t in (c, u))
        assert err_c <= 2**-7, (name, err_c)
        assert err_c <= 1.5 * err_u + 1e-6, (name, err_c, err_u)


def test_all_ignored_gives_zero() -> None:
    h, w = torch.randn(2, 3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.full((2, 3), -100))
    loss.backward()
    assert float(loss) == 0.0 and torch.all(h.grad == 0) and torch.all(w.grad == 0)


def test_bad_inputs_are_named() -> None:
    h, w = torch.randn(2, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        linear_cross_entropy(h, w, torch.zeros(2, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match=r"weight must be \[V, 4\]"):
        linear_cross_entropy(h, torch.randn(5, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must have h's leading shape \(2,\)"):
        linear_cross_entropy(h, w, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"label 5 is outside the vocabulary \[0, 5\)"):
        linear_cross_entropy(h, w, torch.tensor([1, 5]))


@pytest.mark.parametrize("tied", [True, False])
def test_model_loss_equals_logits_loss(tied: bool) -> None:
    cfg = model_registry("debug-moe", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
                         vocab_size=97, num_experts=4, top_k=2, moe_inter_dim=16, tie_word_embeddings=tied).config
    torch.manual_seed(0)
    model = Qwen3Model(cfg)
    model.init_weights()
    tokens = torch.randint(0, 97, (2, 9))
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100

    def run(**kw):
        model.zero_grad(set_to_none=True)
        loss = model(tokens, labels=labels, **kw)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    full_loss, full_grads = run(loss_chunk_size=0)
    ref = F.cross_entropy(model(tokens).float().flatten(0, 1), labels.flatten(), reduction="sum")
    assert_close(full_loss, ref.detach(), torch.float32)
    loss, grads = run(loss_chunk_size=5)
    assert_close(loss, full_loss, torch.float32)
    for n, gr in grads.items():
        assert_close(gr, full_grads[n], torch.float32, msg=n)
    with pytest.raises(ValueError, match=r"labels must have the tokens' shape \(2, 9\)"):
        model(tokens, labels=labels[:, :3])


def _vocab_parallel_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        h, w, y = torch.load(out + ".in")
        rows = w.chunk(world)  # DTensor Shard(0) semantics: ceil(V / world) rows per rank
        start = sum(r.shape[0] for r in rows[:rank])
        got = _grads(lambda a, b, c: linear_cross_entropy(a, b[start:start + rows[rank].shape[0]], c, chunk_size=3,
                                                          group=dist.group.WORLD, vocab_start=start), h, w, y)
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_two_ranks_match_unfused(tmp_path) -> None:
    # V = 11 over 2 ranks: 6 + 5 rows; targets on both ranks, ignored tokens, 3 chunks of 3 + 1 of 1
    import torch.multiprocessing as mp

    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(2, 5, 8, generator=g), torch.randn(11, 8, generator=g)
    y = torch.randint(0, 11, (2, 5), generator=g)
    y[0, 1] = -100
    out = str(tmp_path / "vp")
    torch.save((h, w, y), out + ".in")
    # spawn, not fork: a fork after this process ran OpenMP-threaded ops can deadlock in the child
    mp.spawn(_vocab_parallel_worker, args=(2, f"file://{tmp_path}/store", out), nprocs=2)
    loss, dh, dw = _grads(_reference, h, w, y)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in range(2):
        assert_close(got[r][0], loss, torch.float32, msg=f"loss rank {r}")
        assert_close(got[r][1], dh, torch.float32, msg=f"dh rank {r}")
    # each rank's dW holds the gradient of its own rows (zeros elsewhere, from the slice's backward)
    assert_close(got[0][2][:6], dw[:6], torch.float32)
    assert_close(got[1][2][6:], dw[6:], torch.float32)
    assert torch.all(got[0][2][6:] == 0) and torch.all(got[1][2][:6] == 0)


def test_second_backward_is_refused() -> None:
    h, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.tensor([0, 1, 2])) * 2.0
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward can run only once"):
        loss.backward()
