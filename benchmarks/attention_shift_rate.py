"""How often would the fixed-shift attention forward fall back on a trained model's own attention inputs?

Runs trnkit's native Qwen3 (a flavor, its weights from a trainer checkpoint folder ``step-N`` or random
init) on windows of a text corpus, captures every ``layers[i].attention.core`` input (q, k after the head
norms and RoPE) and counts, per launch (one layer's attention call on one window: what one kernel launch
sees), whether any row fails the fixed-shift forward's certificate
(:func:`trnkit.kernels.attention.fixed_shift_failures`: ``1 / l_i``, the largest probability a row gives
one of its first 512 keys, under ``e^-32 / S`` for a bf16 launch, ``1 / 4S`` for an fp32 one: both rules are
counted). Also per launch: the largest ``log l_i`` against ``log S + 32`` and ``log 4S``, and the fp32 rule's
rate for a variant whose shift also takes the max over the diagonal 512-key bank (the bank holding the
query tile's own keys; the kernel would form that bank first).

Usage: ``python benchmarks/attention_shift_rate.py --flavor debug --vocab 4096 --tokenizer tok.json
--corpus shakespeare --seq 2048 --windows 16 [--checkpoint run/checkpoint/step-100]``.
"""

from __future__ import annotations

import argparse
import math

import torch

from trnkit.kernels.attention import fixed_shift_failures
from trnkit.kernels.attention.attention_torch import causal_score_rows
from trnkit.kernels.attention.shift_rule import NATS_2BYTE, NATS_FP32


def diagonal_failures(q: torch.Tensor, k: torch.Tensor, scale: float, nats: float = NATS_FP32, bank: int = 512,
                      tile: int = 128) -> torch.Tensor:
    """``fixed_shift_failures`` for a shift over the first ``bank`` keys and the query tile's diagonal bank
    (keys ``[bank * floor(r0 / bank), i]`` for row ``i`` of the tile starting at ``r0``)."""
    B, S, Hq, _ = q.shape
    out = torch.zeros(B, Hq, S, dtype=torch.bool)
    for r0, r1, s in causal_score_rows(q, k, scale, tile):
        d0 = r0 // bank * bank
        c = torch.maximum(s[..., :bank].amax(-1, keepdim=True), s[..., d0:].amax(-1, keepdim=True))
        lsum = torch.exp(s - c).sum(-1)
        out[:, :, r0:r1] = ~(lsum <= S * math.exp(nats)) & ~lsum.isnan()
    return out


def log_l(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int = 256) -> torch.Tensor:
    """``[B, Hq, S]``: ``log l_i`` under the first-512-key shift (``-log`` of the largest probability among
    the row's first 512 keys)."""
    B, S, Hq, _ = q.shape
    out = torch.zeros(B, Hq, S)
    for r0, r1, s in causal_score_rows(q, k, scale, rows):
        out[:, :, r0:r1] = torch.logsumexp(s, -1) - s[..., :512].amax(-1)
    return out


def _model(flavor: str, vocab: int, checkpoint: str | None):
    from trnkit.qwen3 import Qwen3Model, model_registry

    torch.manual_seed(0)
    model = Qwen3Model(model_registry(flavor, vocab_size=vocab).config)
    model.init_weights()
    if checkpoint:
        import torch.distributed.checkpoint as dcp

        stored = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
        sd = {k: v for k, v in model.state_dict().items() if f"model.{k}" in stored}  # (tied aliases: once)
        dcp.load({"model": sd}, checkpoint_id=checkpoint)
        missing = [k for k in model.state_dict() if k not in sd]
        model.load_state_dict(sd, strict=False)
        print(f"loaded {len(sd)} tensors from {checkpoint}; not stored (tied): {missing}")
    return model.eval()


def _windows(tokenizer: str, corpus: str, seq: int, n: int, seed: int) -> torch.Tensor:
    """``n`` windows of ``seq`` tokens at seeded random places of the corpus's token stream (the trainer's
    own reading and tokenization: documents joined with EOS)."""
    from trnkit.harness.data import load_tokenizer, read_documents, tokenize_stream

    stream = torch.from_numpy(tokenize_stream(read_documents(corpus), load_tokenizer(tokenizer)).astype("int64"))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq, (n,), generator=g).tolist()
    return torch.stack([stream[s:s + seq] for s in starts])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--corpus", default="shakespeare")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--checkpoint", default=None)
    args = p.parse_args()
    model = _model(args.flavor, args.vocab, args.checkpoint)
    tokens = _windows(args.tokenizer, args.corpus, args.seq, args.windows, args.seed)
    seen = []
    cores = [m for n, m in model.named_modules() if n.endswith("attention.core")]
    for layer, core in enumerate(cores):
        core.register_forward_hook(lambda m, inp, out, layer=layer: seen.append((layer, inp[0], inp[1], m.scale)))
    S = args.seq
    bounds = {rule: math.log(S) + nats for rule, nats in (("bf16", NATS_2BYTE), ("fp32", NATS_FP32))}
    per_layer: dict[int, list] = {}
    with torch.no_grad():
        for w in range(tokens.shape[0]):
            seen.clear()
            model(tokens[w:w + 1])
            for layer, q, k, scale in seen:
                fails = fixed_shift_failures(q, k, scale, nats=NATS_FP32)
                diag = diagonal_failures(q, k, scale)
                ll = log_l(q, k, scale)
                per_layer.setdefault(layer, []).append((bool(fails.any()), bool(diag.any()), float(ll.max()),
                                                        int(fails.sum()), ll.amax(-1).squeeze(0).tolist(),
                                                        bool(fixed_shift_failures(q, k, scale, nats=NATS_2BYTE).any())))
    launches = sum(len(v) for v in per_layer.values())
    fail = sum(r[0] for v in per_layer.values() for r in v)
    dfail = sum(r[1] for v in per_layer.values() for r in v)
    bfail = sum(r[5] for v in per_layer.values() for r in v)
    print(f"checkpoint {args.checkpoint or 'random init'}, S={S}, {args.windows} windows; the bound log l <= "
          f"{bounds['bf16']:.2f} (bf16 launches), {bounds['fp32']:.2f} (fp32 launches)")
    print(f"launches failing: bf16 rule {bfail} / {launches} ({bfail / launches:.1%}); fp32 rule {fail} / {launches} "
          f"({fail / launches:.1%}), with the diagonal bank in the shift {dfail} / {launches} ({dfail / launches:.1%})")
    for layer, v in sorted(per_layer.items()):
        heads = torch.tensor([r[4] for r in v])  # [windows, Hq]: each head's largest log l
        print(f"layer {layer}: fail (fp32 rule) {sum(r[0] for r in v)}/{len(v)}, diag {sum(r[1] for r in v)}/{len(v)}, "
              f"failing rows {sum(r[3] for r in v)}, max log l {max(r[2] for r in v):.2f}; per head max log l "
              f"(median over windows): {[round(x, 2) for x in heads.median(0).values.tolist()]}")


if __name__ == "__main__":
    main()
