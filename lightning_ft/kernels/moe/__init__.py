"""Mixture-of-Experts hot path: sync-free routing and grouped expert GEMMs with split LoRA.

`routing` builds the expert-sorted order of one layer's (token, expert) pairs once; `experts`
(`moe_experts`) runs the experts on it with one of three backends, one module each:
`native_torch`, `grouped_mm`, `grouped_gemm` (``moe.backend=triton``: our Triton grouped GEMM,
whose launchers ``grouped_gemm`` and ``grouped_wgrad`` are imported from that module); `_common`
holds what they share (`ExpertLoRA`, `ExpertBiases`, the SwiGLU step and gpt-oss's `ClampedSwiGLU`).
Nothing here imports transformers; the model wiring is `lightning_ft.model.moe`.
"""

from lightning_ft.kernels.moe._common import ClampedSwiGLU, ExpertBiases, ExpertLoRA
from lightning_ft.kernels.moe.experts import BACKENDS, QUANTISED_EXPERT_BACKENDS, moe_experts, select_backend
from lightning_ft.kernels.moe.grouped_mm import grouped_mm_mode
from lightning_ft.kernels.moe.routing import (
    ExpertRouting,
    permute_tokens,
    sort_by_expert,
    topk_routing,
    unpermute_tokens,
)

__all__ = [
    "BACKENDS",
    "QUANTISED_EXPERT_BACKENDS",
    "ClampedSwiGLU",
    "ExpertBiases",
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
