"""FLOPs of one training step, and the device's measured matmul peak, for MFU.

Counted per token on the architecture itself: transformers' own class for the config, built on the meta
device (no memory, no weights), so every family counts as it computes (``P`` = weights used in matmuls per
token: every 2-D weight of the decoder layers (attention and MLP projections, routers, shared experts, MLA's
low-rank projections), each 3-D expert weight times ``top_k / num_experts`` (a token runs ``top_k`` experts),
and the LM head; embeddings, norms and biases excluded):

    forward                    2·P
    backward, input grads      2·P
    backward, weight grads     2·P   only for trainable base weights (full fine-tuning)
    recompute (checkpointing)  2·P_layers   (the decoder layers' forward again; not the LM head)

plus attention per layer over the (query, key) pairs each document of ``n`` tokens scores: causal, ``n²/2``;
in a layer with a sliding window of ``w`` tokens (``config.layer_types``, or ``sliding_window`` on every layer
where the config lists no types), ``n²/2 − (n − w)²/2`` for ``n > w``. Forward ``2·pairs·heads·(d_qk + d_v)``
(QKᵀ and PV; MLA's query/key and value head dims differ), backward twice that, recompute once more with
checkpointing. LoRA's own matmuls (rank r ≪ hidden) are not counted, so MFU is slightly understated. This is
the PaLM-style accounting (Chowdhery et al. 2022, appendix B) extended with the frozen-weight, recompute and
sliding-window terms.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Sequence


def num_experts(cfg: dict[str, Any]) -> int:
    """The routed experts per MoE layer a config dict names (``num_experts``: Qwen-MoE; ``num_local_experts``: Mixtral,
    gpt-oss; ``n_routed_experts``: DeepSeek-V3, GLM-4.5), 0 for a dense model."""
    return next((int(cfg[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)), 0)


@functools.lru_cache(maxsize=8)
def _architecture(cfg_json: str) -> tuple[int, int, list[tuple[int, int, int, int | None]]]:
    """(decoder-layer matmul weights per token, LM head weights, per layer (heads, d_qk, d_v, window or None))."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_ft.model.support import decoder_of

    cfg = json.loads(cfg_json)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    per_token = 0
    for layer in decoder_of(model).layers:
        for name, p in layer.named_parameters():
            if name.endswith("bias"):  # gpt-oss's expert biases are [num_experts, N]
                continue
            if p.dim() == 2:
                per_token += p.numel()
            elif p.dim() == 3:  # [num_experts, ...]: top_k of them per token
                per_token += p.numel() // p.shape[0] * top_k
    head = model.get_output_embeddings().weight.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    d_qk = nope + rope if nope and rope else head_dim
    d_v = getattr(config, "v_head_dim", None) or head_dim
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    windows = [window if (types[i] == "sliding_attention" if types else True) else None for i in range(config.num_hidden_layers)]
    return per_token, head, [(heads, d_qk, d_v, w) for w in windows]


def matmul_params_per_token(cfg: dict[str, Any]) -> tuple[int, int]:
    """(weights of the decoder layers, weights of the LM head) used per token, for the config dict ``cfg``
    (``model_type`` and the fields transformers' config takes); see the module docstring."""
    layers, head, _ = _architecture(json.dumps(cfg, sort_keys=True))
    return layers, head


def _pairs(n: int, window: int | None) -> float:
    """(query, key) pairs a causal document of ``n`` tokens scores, half the square (PaLM's count), less what a
    sliding window of ``window`` tokens leaves out."""
    return n * n / 2 - (max(n - window, 0) ** 2 / 2 if window else 0)


def train_step_flops(
    cfg: dict[str, Any], doc_lengths: Sequence[int], gradient_checkpointing: bool, base_trainable: bool = False
) -> float:
    """FLOPs of one forward+backward over documents of ``doc_lengths`` tokens (module docstring)."""
    layers, head, attention = _architecture(json.dumps(cfg, sort_keys=True))
    tokens = sum(doc_lengths)
    per_token = (6 if base_trainable else 4) * (layers + head) + (2 * layers if gradient_checkpointing else 0)
    attn_fwd = sum(2 * heads * (d_qk + d_v) * sum(_pairs(n, w) for n in doc_lengths) for heads, d_qk, d_v, w in attention)
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
