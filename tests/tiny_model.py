"""The tiny random-init Qwen3-MoE the CPU tests build (2 layers, 4 experts, top-2, vocabulary 64) and its LoRA."""

TINY_MODEL = {
    "init": "random",
    "config": dict(
        model_type="qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, vocab_size=64,
    ),
}
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "o_proj"]}
