"""The systems a benchmark compares, each building a model and taking training steps its own way.

- ``hf_peft``: stock transformers + PEFT as a user writes it: SDPA attention, the ``grouped_mm``
  experts implementation for MoE, PEFT ``target_parameters`` for expert LoRA, non-reentrant
  gradient checkpointing, bf16 weights under bf16 autocast (fp32 adapters), AdamW on the adapters,
  ``model(input_ids, labels=input_ids).loss``. The baseline of every ratio.
- ``liger``: the same after Liger Kernel's ``apply_liger_kernel_to_<arch>()``.
- ``lightning_ft``: our `FinetuneModule` with the benchmark's kernels config, trained by a
  Lightning `Trainer` exactly as ``fit`` does (the step time includes Lightning's loop).

Every system sees the same batch: one sequence of ``seq_len`` random tokens (seeded), batch 1.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import lightning as L
import torch

SYSTEMS = ("hf_peft", "liger", "lightning_ft")

_LIGER_PATCHES = {"llama": "apply_liger_kernel_to_llama", "qwen3": "apply_liger_kernel_to_qwen3",
                  "qwen3_moe": "apply_liger_kernel_to_qwen3_moe"}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _hf_model(spec: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(spec["model_config"])
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa", "dtype": spec["dtype"]}
    if getattr(hf_config, "num_experts", None) and spec["device"].startswith("cuda"):
        kwargs["experts_implementation"] = "grouped_mm"
    with torch.device(spec["device"]):
        model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
    if spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def hf_peft_steps(spec: dict[str, Any], input_ids: torch.Tensor, num_steps: int, liger: bool = False) -> tuple[list[float], float]:
    """Run ``num_steps`` training steps of stock transformers + PEFT; returns (seconds per step, last loss)."""
    if liger:
        import liger_kernel.transformers as lk

        getattr(lk, _LIGER_PATCHES[spec["model_config"]["model_type"]])()
    from lightning_ft.modules.finetune_module import add_lora

    model = add_lora(_hf_model(spec), spec["lora"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    device = spec["device"]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu", enabled=False)
    times, loss = [], torch.zeros(())
    for _ in range(num_steps):
        _sync(device)
        t0 = time.perf_counter()
        with autocast:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, float(loss)


def lightning_ft_steps(spec: dict[str, Any], input_ids: torch.Tensor, num_steps: int) -> tuple[list[float], float]:
    """Run ``num_steps`` steps of `FinetuneModule` under a Lightning `Trainer`; returns (seconds per step, last loss)."""
    from lightning_ft.data.packing import collate_packed
    from lightning_ft.modules.finetune_module import FinetuneModule

    ids = input_ids[0].tolist()
    batch = collate_packed([(ids, ids)])
    timer = StepTimer(spec["device"])
    module = FinetuneModule(
        model={
            "init": "random",
            "config": dict(spec["model_config"]),
            "dtype": {torch.bfloat16: "bfloat16", torch.float32: "float32"}[spec["dtype"]],
            "gradient_checkpointing": spec["gradient_checkpointing"],
            **spec.get("model_options", {}),
        },
        lora=spec["lora"],
        kernels=spec["kernels"],
        moe=spec["moe"],
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
    )
    cuda = spec["device"].startswith("cuda")
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=num_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        use_distributed_sampler=False,
    )
    loader = torch.utils.data.DataLoader([batch] * num_steps, batch_size=1, collate_fn=lambda items: items[0])
    trainer.fit(module, train_dataloaders=loader)
    return timer.times, module.step_losses[-1]


class StepTimer(L.Callback):
    """Times each training batch with the device synchronised at both ends."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        _sync(self.device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        _sync(self.device)
        self.times.append(time.perf_counter() - self._t0)


STEP_FUNCTIONS: dict[str, Callable[..., tuple[list[float], float]]] = {
    "hf_peft": hf_peft_steps,
    "liger": lambda spec, ids, n: hf_peft_steps(spec, ids, n, liger=True),
    "lightning_ft": lightning_ft_steps,
}
