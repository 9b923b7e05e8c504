"""Fused ops of the training hot path, one module per op: the Triton kernels, their launchers, one
torch.autograd.Function and a plain-torch reference of the same math (`lora` is torch ops only; `moe`
is a package). Nothing here imports transformers; the HF wiring lives in `lightning_ft.model.patching`
and `lightning_ft.model.moe`.

    rms_norm.rms_norm(x, weight, eps, offset=, fp32_scale=)       RMSNorm (HF Llama/Qwen3 math; Gemma's)
    rope.apply_rope(q, k, cos, sin)                               RoPE on q and k, in place
    swiglu.swiglu(gate, up, activation)                           act(gate) * up: SwiGLU (silu), GeGLU (gelu_tanh)
    clamped_swiglu.clamped_swiglu(h, alpha, limit, ...)           gpt-oss's clamped SwiGLU on interleaved gate/up
    attention_sinks.sink_forward(out, lse, sinks)                 attention sinks: out · σ(lse − sink) (and its backward)
    linear_cross_entropy.fused_linear_cross_entropy(h, w, labels) chunked LM head + CE: (loss sum, count)
    lora.lora_linear(x, weight, bias, lora_A, lora_B, scaling)    x Wᵀ + b + scaling · (x Aᵀ) Bᵀ, three GEMMs
    nf4.dequantize_4bit(weight, dtype)                             bitsandbytes' NF4/FP4 layout -> a dense weight (reused buffer)
    qlora.qlora_linear(x, weight4, bias, lora_A, lora_B, scaling) lora_linear on a 4-bit base: dequantise, then the GEMMs
    moe.moe_experts(x, topk_weight, routing, ...)                 MoE experts with split LoRA on sync-free
                                                                  routing (`moe.routing`); backends in `moe`

No names are re-exported here: a function named like its module would shadow the module.
"""
