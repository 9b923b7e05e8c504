"""The check shared by the quantised-experts tests: a model with packed experts steps as its dequantised twin."""

import torch


def lora_step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and trainable gradients of one forward and backward on fixed ids (vocabulary 64), after drawing every
    LoRA B non-zero (seed 1) so that every factor gets a gradient."""
    torch.manual_seed(1)
    for name, param in sorted(model.named_parameters()):
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2)).to(next(model.parameters()).device)
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same_step(step, twin_step, expert_grads: int, rtol: float = 0.0) -> None:
    """Two `lora_step` results are equal (bit for bit; with ``rtol``, to that fraction of each tensor's largest
    value), ``expert_grads`` of the gradients the experts' LoRA's, none zero."""
    (logits, grads), (twin_logits, twin_grads) = step, twin_step
    assert grads.keys() == twin_grads.keys() and sum("experts" in name for name in grads) == expert_grads
    for name, (got, expected) in {"logits": (logits, twin_logits), **{n: (g, twin_grads[n]) for n, g in grads.items()}}.items():
        assert got is not None and got.abs().max() > 0, name
        torch.testing.assert_close(got, expected, rtol=0, atol=rtol * expected.abs().max().item(), msg=name)
