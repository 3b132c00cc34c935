"""Parity tolerances, in one place.

**Kernels (tests/kernels): the fp64-oracle rule.** A kernel output passes when it is at least nearly as
accurate as torch computing the same thing at the same dtype, both measured against an fp64 oracle::

    err(kernel) <= 1.5 * err(torch) + floor,     err(a) = ||a - oracle||_F / ||oracle||_F,
    floor = max(eps_out / 4, eps_fp32 * max(2, 32 / sqrt(n)), eps_test * 4 / sqrt(n))

``eps_out`` is the machine epsilon of the kernel output's dtype (2**-23 fp32, 2**-7 bf16), ``eps_test``
that of the dtype torch computed in (the test dtype), ``n`` the number of output elements. The floor is rounding
noise no implementation choice decides: a quarter ulp
of the output dtype (where a result is exact or pure output rounding, the ratio of two tiny errors
means nothing), and fp32 summation-order noise, since every kernel computes in fp32 and sums in its
own order (the PE array accumulates sequentially) while torch's error at a small shape can sit well
below its large-shape level (router logits fp32, kernel vs torch: H=64 1.4 vs 0.77 eps, H=161 1.4 vs
1.2 eps, H=2048 1.8 vs 2.1 eps): two fp32 ulps, and on outputs of a few elements, where torch's error
is one or a few draws of that noise, amplified by the condition number of a cancelling sum, 32 / sqrt(n)
ulps (one T=1 router weight: kernel 1.3 vs torch 0.06 eps; one T=1, K=1 MoE grad_topk_weights, a dot
product of condition number 126: kernel 16.7 vs torch 1.7 eps, with other seeds torch the worse one, e.g.
cond 18: 3.5 vs 5.3 eps), and likewise 4 / sqrt(n) ulps of the test dtype where the computation is bf16
(one T=1 bf16 MoE grad_topk_weights, an fp32 output of a bf16 dot product: kernel 0.46 vs torch 0.06
bf16 eps). For fp32 the floor is 3.8e-6 relative for one element and 2.4e-7 from n = 256 on (the fixed
tolerance it replaced allowed 1e-5 per element); for bf16, 3.1% for one element, and from n = 256 on
a quarter bf16 ulp, below torch's own bf16 rounding error. The error is a relative Frobenius norm
over the whole output (or the parts of a streamed one, :class:`OracleErr`), so it scales with the
reduction length and the data, unlike a fixed element-wise tolerance. The oracle and the torch baseline
are one plain-torch function (``tests/kernels/oracles.py``) evaluated in float64 and in the test dtype on
the same dtype-rounded inputs; a test against transformers uses transformers' own code for both.
:func:`check_oracle` also reports the max-abs errors in its message. A test may add to the right-hand side a
relative allowance it derives from the inputs for an error its kernel's design accepts (``extra``, or per part
the error tensor itself, ``OracleErr.add(..., derived=)``; the fused cross-entropy's probabilities formed from its
fp32 ``lse``: ``tests/kernels/cross_entropy``; the attention backward's ``delta`` from the stored ``O``:
``tests/kernels/attention``), which the message prints as ``(derived)``.

**Elsewhere (model-level parity: overrides, qwen3, trainer):** ``assert_close(actual, expected, dtype)``,
element-wise ``|a - e| <= atol + rtol * |e|``:
- float32: the compared paths accumulate in fp32 in a different order, errors a few ulps times
  sqrt(reduction length) at the small shapes these tests run: rtol 1e-5, atol 1e-5.
- bfloat16: outputs are rounded once to bf16 (unit roundoff 2**-8 = 3.9e-3), and a reference computed
  from the same bf16 inputs in fp32 may round the other way at a tie, i.e. differ by one bf16 ulp
  (2**-7 relative): rtol 2**-7 = 7.8e-3, plus a small atol for values near zero.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64
ORACLE_RATIO = 1.5

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # dtype: (rtol, atol)
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2**-7, 1e-3),
}


def tol(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 msg: str = "") -> None:
    """Compare in fp32 with the tolerance of ``dtype`` (default: ``expected.dtype``)."""
    rtol, atol = tol(dtype or expected.dtype)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol, msg=msg or None)


class OracleErr:
    """The fp64-oracle rule over an output given whole or in parts (``add`` per part, then ``check``):
    sums of squares, so a production-size output never needs a full fp64 copy."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.sq = {"result": 0.0, "torch": 0.0, "oracle": 0.0}
        self.max_abs = {"result": 0.0, "torch": 0.0}
        self.n = 0
        self.test_dtype = dtype

    def add(self, result: torch.Tensor, baseline: torch.Tensor, oracle: torch.Tensor,
            derived: torch.Tensor | None = None) -> None:
        """``derived``: this part's share of an error the kernel's design accepts, as a tensor (its norm,
        relative to the oracle's, joins ``check``'s allowance)."""
        assert result.shape == baseline.shape == oracle.shape, (self.name, result.shape, baseline.shape,
                                                                oracle.shape)
        if derived is not None:
            self.sq["derived"] = self.sq.get("derived", 0.0) + float(derived.to(F64).square().sum())
        o = oracle.to(F64).reshape(-1)
        for key, t in (("result", result), ("torch", baseline)):
            d = t.reshape(-1).to(F64, copy=True).sub_(o)  # (a copy even when t is already fp64)
            self.sq[key] += float(torch.dot(d, d))
            if d.numel():
                self.max_abs[key] = max(self.max_abs[key], float(torch.linalg.vector_norm(d, float("inf"))))
        self.sq["oracle"] += float(torch.dot(o, o))
        self.n += o.numel()
        self.test_dtype = baseline.dtype

    def errors(self) -> tuple[float, float]:
        norm = max(math.sqrt(self.sq["oracle"]), 1e-300)
        return math.sqrt(self.sq["result"]) / norm, math.sqrt(self.sq["torch"]) / norm

    def check(self, extra: float = 0.0) -> None:
        """``extra``: a relative allowance the caller derives for an error its kernel's design accepts (added
        to the one the parts' ``derived`` tensors give)."""
        ek, et = self.errors()
        extra += math.sqrt(self.sq.get("derived", 0.0)) / max(math.sqrt(self.sq["oracle"]), 1e-300)
        eps32 = torch.finfo(torch.float32).eps
        root_n = math.sqrt(max(self.n, 1))
        floor = max(torch.finfo(self.dtype).eps / 4, eps32 * max(2.0, 32 / root_n),
                    torch.finfo(self.test_dtype).eps * 4 / root_n)
        assert ek <= ORACLE_RATIO * et + floor + extra, (
            f"{self.name}: error vs the fp64 oracle {ek:.3e} > {ORACLE_RATIO} x torch's {et:.3e} + {floor:.1e}"
            + (f" + {extra:.1e} (derived)" if extra else "") + " "
            f"(max abs: {self.max_abs['result']:.3e} vs torch's {self.max_abs['torch']:.3e})")


def check_oracle(name: str, result: torch.Tensor, baseline: torch.Tensor, oracle: torch.Tensor,
                 extra: float = 0.0) -> None:
    """The fp64-oracle rule on one whole output (module docstring); ``baseline`` is torch at the test dtype;
    ``extra``: a relative allowance the caller derives for an error its kernel's design accepts."""
    err = OracleErr(name, result.dtype)
    err.add(result, baseline, oracle)
    err.check(extra)
