"""GradientCheck on the tiny Qwen3-MoE with LoRA on attention and on the 3-D expert weights (PEFT target_parameters)."""

from types import SimpleNamespace

import pytest
import torch

from lightning_ft.callbacks.gradient_check import GradientCheck
from lightning_ft.data.packing import collate_packed
from lightning_ft.errors import TrainingStopped
from lightning_ft.model.build import ModelBuilder
from lightning_ft.module import FinetuneModule

from tiny_model import TINY_MODEL as TINY_MOE

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def _train(module, check, lrs):
    """One optimizer step per learning rate, calling the check where Lightning would."""
    optimizer = torch.optim.AdamW([p for p in module.model.parameters() if p.requires_grad])
    batch = collate_packed([(list(range(1, 40)), list(range(1, 40)))])
    for step, lr in enumerate(lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        module.loss_sum(batch).backward()
        check.on_before_optimizer_step(SimpleNamespace(global_step=step), module, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _module():
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model=TINY_MOE, lora=LORA))
    module.configure_model()
    return module


def test_every_adapter_of_the_stock_forward_gets_gradient_after_a_warmup_step():
    check = GradientCheck(steps=2)
    _train(_module(), check, lrs=[0.0, 1e-3, 1e-3])  # a step at lr 0 is not counted (lora_B stays zero)
    assert check._counted == 2


def test_an_adapter_the_forward_skips_is_named():
    module = _module()
    experts = module.model.base_model.model.model.layers[0].mlp.experts
    experts.forward = experts.base_layer.forward  # a fused expert forward that ignores the down_proj adapter
    with pytest.raises(TrainingStopped, match=r"model.layers.0.mlp.experts \[down_proj\] \(lora_A, lora_B\)"):
        _train(module, GradientCheck(steps=2), lrs=[1e-3, 1e-3])


def test_a_trainable_module_with_a_zero_gradient_is_named():
    """Not only LoRA: a lora.modules_to_save copy whose gradient is exactly zero trains untouched too."""
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model=TINY_MOE, lora={**LORA, "modules_to_save": ["lm_head"]}))
    module.configure_model()
    head = module.model.base_model.model.lm_head.modules_to_save["default"]
    head.register_forward_hook(lambda m, args, out: out * 0)  # the loss no longer depends on its weight
    with pytest.raises(TrainingStopped, match=r"lm_head.modules_to_save.default.weight \(no gradient, or zero\)"):
        _train(module, GradientCheck(steps=2), lrs=[1e-3, 1e-3])


def test_a_diverged_update_is_named_instead_of_the_forward():
    """A learning rate far too high zeroes gradients through saturated softmaxes: the error names the learning rate."""
    with pytest.raises(TrainingStopped, match=r"^the updates diverged: lower optimizer.lr .*\(now 1e\+12\)"):
        _train(_module(), GradientCheck(steps=2), lrs=[1e12, 1e12])
