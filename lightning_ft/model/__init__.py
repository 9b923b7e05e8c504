"""The model side: building the HF model, the per-architecture patch tables, attention, MoE and LoRA wiring."""
