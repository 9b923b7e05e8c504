"""Which thin LoRA product runs where at the Qwen3-30B-A3B expert shape (8K tokens x top-8), bf16."""
import logging, sys
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from lightning_ft.kernels.moe import grouped_gemm as gg
from lightning_ft.kernels.moe import sort_by_expert
torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
T, K, E, R, D, I = 8192, 8, 128, 16, 2048, 768
idx = torch.randn(T, E, device=dev).topk(K, dim=-1).indices
routing = sort_by_expert(idx, E)
x = torch.randn(T, D, device=dev, dtype=bf, requires_grad=True)
w = torch.softmax(torch.randn(T, K, device=dev), -1).requires_grad_()
wgu = torch.randn(E, 2 * I, D, device=dev, dtype=bf) / D**0.5
wd = torch.randn(E, D, I, device=dev, dtype=bf) / I**0.5
def lora(n, c):
    a = (torch.randn(R * E, c, device=dev) / c**0.5).requires_grad_()
    b = (torch.randn(n, R * E, device=dev) * 0.01).requires_grad_()
    return a, b
(agu, bgu), (ad, bd) = lora(2 * I, D), lora(D, I)
out = gg.moe_experts(x, w, routing, wgu, wd, torch.nn.SiLU(), gate_up_lora=gg.ExpertLoRA(agu, bgu, 2.0, E),
                     down_lora=gg.ExpertLoRA(ad, bd, 2.0, E), backend="grouped_mm")
out.float().square().mean().backward()
torch.cuda.synchronize()
for key, choice in gg._THIN_CHOICES.items():
    print("choice", key[0], key[1:4], key[-1], "->", choice)
