"""Mixture-of-Experts hot path: sync-free routing and grouped expert GEMMs with split LoRA.

`routing` builds the expert-sorted order of one layer's (token, expert) pairs once; `grouped_gemm`
runs the experts on it with one of three backends (``native_torch``, ``grouped_mm``, ``triton``);
its Triton launchers (``grouped_gemm``, ``grouped_wgrad``) are imported from that module.
Nothing here imports transformers; the model wiring is `lightning_ft.model.moe`.
"""

from lightning_ft.kernels.moe.grouped_gemm import (
    BACKENDS,
    ExpertLoRA,
    grouped_mm_mode,
    moe_experts,
    select_backend,
)
from lightning_ft.kernels.moe.routing import (
    ExpertRouting,
    permute_tokens,
    sort_by_expert,
    topk_routing,
    unpermute_tokens,
)

__all__ = [
    "BACKENDS",
    "ExpertLoRA",
    "ExpertRouting",
    "grouped_mm_mode",
    "moe_experts",
    "permute_tokens",
    "select_backend",
    "sort_by_expert",
    "topk_routing",
    "unpermute_tokens",
]
