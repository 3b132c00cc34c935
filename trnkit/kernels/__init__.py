from trnkit.kernels.moe import (  # noqa: F401  (MoE grouped expert matmul)
    from_hf_v5,
    from_torchtitan,
    grouped_mm,
    grouped_mm_bwd,
    grouped_mm_bwd_ref,
    grouped_mm_ref,
    moe_experts,
    moe_experts_bwd,
    moe_experts_bwd_ref,
    moe_experts_ref,
    to_hf_v5,
    to_torchtitan,
)
from trnkit.kernels.rope_hf import (  # noqa: F401  (HF rotate-half RoPE)
    rope_hf,
    rope_hf_bshd,
    rope_hf_bshd_ref,
    rope_hf_ref,
)
from trnkit.kernels.router_topk import (  # noqa: F401  (Qwen3-MoE router top-k)
    router_topk,
    router_topk_bwd,
    router_topk_bwd_ref,
    router_topk_ref,
)
