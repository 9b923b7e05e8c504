"""Fused Triton ops of the training hot path, one module per op: the kernels, their launchers, one
torch.autograd.Function and a plain-torch reference of the same math. Nothing here imports
transformers; the HF wiring lives in `lightning_ft.model.patching`.

    rms_norm.rms_norm(x, weight, eps)                            RMSNorm (HF Llama/Qwen3 math)
    rope.apply_rope(q, k, cos, sin)                               RoPE on q and k, in place
    swiglu.swiglu(gate, up)                                       silu(gate) * up
    linear_cross_entropy.fused_linear_cross_entropy(h, w, labels) chunked LM head + CE: (loss sum, count)

No names are re-exported here: a function named like its module would shadow the module.
"""
