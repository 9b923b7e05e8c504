"""`GradientCheck`: stop early when a trainable tensor, or a LoRA adapter, gets no gradient.

A LoRA adapter whose layer the (patched) forward never calls trains silently untouched: its
gradient stays None or exactly zero while the loss still falls through the other adapters. A
known case is MoE LoRA on experts when a fused expert forward bypasses the adapter weights. Any
other trainable tensor (a ``lora.modules_to_save`` copy, a trained router, a weight of full
fine-tuning) whose gradient is None or exactly zero trains untouched the same way.

What "gets a gradient" means for a LoRA pair (``y = W x + scaling · B A x``, ``B`` zero-initialised)::

    step 1   dL/dB = scaling · g (A x)ᵀ   non-zero            dL/dA = scaling · Bᵀ g xᵀ = 0 (B = 0)
    step 2   B ≠ 0 after step 1's update  →  dL/dA non-zero too

so within the first ``steps`` optimizer steps (default 2) every ``lora_B`` and then every ``lora_A``,
and every other trainable tensor, must have had a non-zero gradient.
Only steps with a non-zero learning rate are watched (a warm-up from 0 leaves ``B`` at zero after
its first step); a run shorter than the window is not checked. Non-finite gradients are left to ``train.on_nonfinite`` (`FinetuneModule`), which stops on them by
default and names the tensors. A gradient that is zero only up to rounding passes: a trained router
under top-1 routing with normalised weights gets ~1e-10 from the LM loss, which the model builder
explains in a warning at the start instead (`lightning_ft.model.router.router_gradient_note`).

A learning rate far too high gives the same symptom by another road: the first update throws the weights
that did get a gradient to magnitudes like the learning rate's, softmaxes saturate to one-hot and their
gradients are then exactly zero. Where a trainable tensor that got a gradient holds a value above
`DIVERGED_WEIGHT` at the end of the window, the error says so and names ``optimizer.lr``.
"""

from __future__ import annotations

import re

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_ft.errors import TrainingStopped
from lightning_ft.strategies.fsdp2 import local_tensor

# PEFT names: <module>.lora_A.<adapter>.weight, <module>.lora_embedding_B.<adapter>
_LORA_NAME = re.compile(r"^(?P<module>.+)\.lora_(?:embedding_)?(?P<half>[AB])\.[^.]+(?:\.weight)?$")
_PEFT_PREFIX = "base_model.model."
#: a weight magnitude no fine-tuned tensor reaches unless the updates diverged (LoRA factors start at ~1/sqrt(in))
DIVERGED_WEIGHT = 1e4


class GradientCheck(L.Callback):
    """Checks the gradients of the first ``steps`` optimizer steps (before each update).

    Args:
        steps: how many optimizer steps to watch (at least 2, so that ``lora_A`` can show its
            gradient once ``lora_B`` has left zero).

    Raises:
        ValueError: ``steps`` < 2.
        TrainingStopped: at the end of the window, naming the modules whose adapters (or
            trainable tensors) never received a (non-zero) gradient.
    """

    def __init__(self, steps: int = 2):
        if steps < 2:
            raise ValueError(f"callbacks.gradient_check.steps={steps}: must be at least 2 (lora_A's gradient is zero at step 1)")
        self.steps = steps
        self._seen: set[str] = set()  # tensors that had a non-zero gradient
        self._counted = 0  # watched steps so far (steps with a non-zero learning rate)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen.clear()
        self._counted = 0

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        if self._counted >= self.steps or not any(group["lr"] > 0 for group in optimizer.param_groups):
            return
        self._counted += 1
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        with_grad = [(n, p.grad) for n, p in named if p.grad is not None and n not in self._seen]
        if with_grad:
            norms = torch.stack(torch._foreach_norm([local_tensor(g) for _, g in with_grad]))
            if any(isinstance(g, DTensor) for _, g in with_grad):  # FSDP2: a gradient is zero only if every shard is
                norms = trainer.strategy.reduce(norms.square(), reduce_op="sum")
            norms = norms.tolist()  # one host sync
            # a NaN norm counts as "got a gradient": non-finite steps are train.on_nonfinite's business
            self._seen.update(n for (n, _), norm in zip(with_grad, norms) if norm != 0)
        if self._counted == self.steps:
            self._raise_if_untouched(named, pl_module, trainer, optimizer)

    def _raise_if_untouched(
        self, named: list[tuple[str, torch.Tensor]], pl_module: L.LightningModule, trainer: L.Trainer, optimizer: torch.optim.Optimizer,
    ) -> None:
        missing = [n for n, _ in named if n not in self._seen]  # the same on every process (the norms were reduced)
        if not missing:
            return
        step = trainer.global_step + 1
        largest = self._largest_trained(named, trainer)
        lora_modules: dict[str, set[str]] = {}
        others = []
        for n in missing:
            m = _LORA_NAME.match(_strip(n))
            if m:
                lora_modules.setdefault(_describe(pl_module, m["module"]), set()).add(f"lora_{m['half']}")
            else:
                others.append(_strip(n))
        lines = [f"  {module} ({', '.join(sorted(halves))})" for module, halves in sorted(lora_modules.items())]
        lines += [f"  {n} (no gradient, or zero)" for n in others]
        if largest > DIVERGED_WEIGHT:
            rates = sorted({group["lr"] for group in optimizer.param_groups})
            raise TrainingStopped(
                f"the updates diverged: lower optimizer.lr (LoRA fine-tuning uses ~1e-5 to 1e-3). After {self.steps} steps "
                f"with a non-zero learning rate (now {', '.join(f'{r:g}' for r in rates)}) the trained tensors hold values "
                f"up to {largest:.3g}, and {len(missing)} others got no gradient at all (saturated softmaxes give exactly "
                f"zero), e.g.:\n" + "\n".join(lines[:3])
            )
        raise TrainingStopped(
            f"after {step} optimizer steps ({self.steps} with a non-zero learning rate) these trainable tensors never "
            "received a non-zero gradient, so they "
            f"would train silently untouched:\n" + "\n".join(lines) + "\n"
            "Their layers are not on the path from the inputs to the loss: a patched forward that bypasses the "
            "adapter (e.g. moe.backend with LoRA on experts), a lora.target_modules or lora.modules_to_save entry the "
            "model does not use, or a path whose gradient is zero by construction. "
            "Fix that, or remove the check with callbacks.gradient_check=null"
        )

    def _largest_trained(self, named: list[tuple[str, torch.Tensor]], trainer: L.Trainer) -> float:
        """The largest |value| of the trainable tensors that got a gradient (inf if one holds a NaN), over every
        process's shards (FSDP2); one host sync."""
        trained = [local_tensor(p.detach()) for n, p in named if n in self._seen]
        device = named[0][1].device
        amax = [t.abs().amax().float().to(device) for t in trained if t.numel()]
        largest = torch.stack(amax).max() if amax else torch.zeros((), device=device)
        largest = torch.nan_to_num(largest, nan=float("inf"))
        if any(isinstance(p, DTensor) for _, p in named):  # each process holds its shards
            largest = trainer.strategy.reduce(largest, reduce_op="max")
        return largest.item()


def _strip(name: str) -> str:
    """``model.base_model.model.model.layers.0...`` → ``model.layers.0...`` (the HF model's own names)."""
    name = name.removeprefix("model.")
    return name.removeprefix(_PEFT_PREFIX)


def _describe(pl_module: L.LightningModule, module_name: str) -> str:
    """The module's name, plus the parameter a PEFT ``ParamWrapper`` (``target_parameters``) adapts."""
    for prefix in ("model." + _PEFT_PREFIX, "model.", ""):
        try:
            module = pl_module.get_submodule(prefix + module_name)
        except AttributeError:
            continue
        parameter = getattr(module, "parameter_name", None)
        return f"{module_name} [{parameter}]" if parameter else module_name
    return module_name
