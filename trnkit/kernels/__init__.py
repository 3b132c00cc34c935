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
