"""FLOPs of one training step, and the device's measured matmul peak, for MFU.

Counted per token, from the model config (``P`` = weights used in matmuls per token: attention
projections, dense MLP or router + ``top_k`` experts, LM head; embeddings excluded):

    forward                    2·P
    backward, input grads      2·P
    backward, weight grads     2·P   only for trainable base weights (full fine-tuning)
    recompute (checkpointing)  2·P_layers   (the decoder layers' forward again; not the LM head)

plus attention over each document of ``n`` tokens (causal, so half the n² score matrix):
forward ``2·n²·heads·head_dim`` per layer (QKᵀ and PV), backward twice that, recompute once more
with checkpointing. LoRA's own matmuls (rank r ≪ hidden) are not counted, so MFU is slightly
understated. This is the PaLM-style accounting (Chowdhery et al. 2022, appendix B) extended with
the frozen-weight and recompute terms.
"""

from __future__ import annotations

from typing import Any, Sequence


def matmul_params_per_token(cfg: dict[str, Any]) -> tuple[int, int]:
    """(weights of the decoder layers, weights of the LM head) used per token."""
    h = cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o and k, v
    if cfg.get("num_experts"):
        mlp = h * cfg["num_experts"] + cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    else:
        mlp = 3 * h * cfg["intermediate_size"]
    return cfg["num_hidden_layers"] * (attn + mlp), h * cfg["vocab_size"]


def train_step_flops(
    cfg: dict[str, Any], doc_lengths: Sequence[int], gradient_checkpointing: bool, base_trainable: bool = False
) -> float:
    """FLOPs of one forward+backward over documents of ``doc_lengths`` tokens (module docstring)."""
    layers, head = matmul_params_per_token(cfg)
    tokens = sum(doc_lengths)
    per_token = (6 if base_trainable else 4) * (layers + head) + (2 * layers if gradient_checkpointing else 0)
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    attn_fwd = cfg["num_hidden_layers"] * 2 * heads * hd * sum(n * n for n in doc_lengths)
    return per_token * tokens + attn_fwd * (3 + (1 if gradient_checkpointing else 0))


def measured_peak_flops(device: str = "cuda", n: int = 8192, repeats: int = 10) -> float | None:
    """bf16 matmul FLOP/s measured on ``device`` (n×n×n products on random data); None on the CPU."""
    import torch

    if not device.startswith("cuda"):
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3)
