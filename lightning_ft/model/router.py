"""MoE router training and the load-balancing loss, the same for every ``moe.backend`` (``hf`` included).

Router training (``moe.train_router``):

- with LoRA, the routers (``mlp.gate`` in Qwen3-MoE: the modules of the patch tables' ``router``
  class, `lightning_ft.model.patching.MoEClasses`) join PEFT's ``modules_to_save``
  (`router_module_names`, added to ``lora.modules_to_save`` by the model builder): PEFT wraps each in
  a ``ModulesToSaveWrapper`` whose trainable copy the forward calls (the original stays frozen),
  ``save_pretrained`` writes the copy into the adapter file and ``PeftModel.from_pretrained``
  puts it back, so the trained router ships with the adapter;
- without LoRA (``lora.enabled=false``) every weight trains but the routers, unless
  ``moe.train_router`` (`freeze_routers`).

`check_router_training` refuses a built model whose routers train other than ``moe.train_router``
says (a ``lora.init_from`` adapter or ``lora.modules_to_save`` that disagrees) and returns the
warning for a router that the LM loss cannot move (`router_gradient_note`).

Load-balancing loss (``model.config.output_router_logits`` and ``router_aux_loss_coef``; Qwen3-MoE
and Mixtral, refused for GLM-4.5 and DeepSeek-V3, whose transformers code computes none):
`load_balancing_loss` is transformers' own ``load_balancing_loss_func`` of the model's modeling
module (Switch Transformer, eqs. 4-6: ``num_experts · Σ_e f_e · P_e`` over every layer's tokens),
called on the router logits that transformers' ``output_router_logits`` hooks collect, exactly as
the model's ``forward`` calls it. A packed row holds no padding (every token belongs to a document),
so it is called without an ``attention_mask``; on an unpacked batch transformers passes its padding
mask, which drops the same padding tokens. `lightning_ft.module.FinetuneModule` adds
``router_aux_loss_coef · aux_loss`` to each micro-batch's loss, as the model's ``forward`` adds it
to its ``loss``.

Sources: transformers v5 ``models/qwen3_moe/modeling_qwen3_moe.py`` (``Qwen3MoeTopKRouter``,
``load_balancing_loss_func``, ``Qwen3MoeForCausalLM.forward``); PEFT 0.21 ``utils/other.py``
(``ModulesToSaveWrapper``, ``_set_trainable``).
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable

import torch

from lightning_ft.model.patching import moe_classes

__all__ = [
    "aux_loss_coef",
    "check_router_training",
    "freeze_routers",
    "load_balancing_loss",
    "load_balancing_loss_function",
    "router_gradient_note",
    "router_module_names",
]


def _routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    routers = moe_classes("router")
    return [(name, m) for name, m in model.named_modules() if isinstance(m, routers)]


def _in_layer(name: str) -> str:
    """``base_model.model.model.layers.3.mlp.gate.modules_to_save.default`` → ``mlp.gate``."""
    return re.sub(r"\.(modules_to_save\.[^.]+|original_module)$", "", re.sub(r"^.*\.\d+\.", "", name))


def router_module_names(model: torch.nn.Module) -> list[str]:
    """The routers' module names within their decoder layer (``mlp.gate``), as PEFT's ``modules_to_save`` takes them.

    Raises:
        ValueError: ``model`` has no router of a class the patch tables name (a dense model, or an
            MoE architecture without a table), naming ``moe.train_router``.
    """
    names = sorted({_in_layer(name) for name, _ in _routers(model)})
    if not names:
        classes = ", ".join(c.__name__ for c in moe_classes("router"))
        raise ValueError(
            f"moe.train_router=true: {type(model).__name__} has no MoE router ({classes}) to train; "
            "set moe.train_router=false"
        )
    return names


def freeze_routers(model: torch.nn.Module) -> int:
    """Freeze every router weight (full fine-tuning with ``moe.train_router=false``); returns how many modules."""
    routers = _routers(model)
    for _, router in routers:
        router.requires_grad_(False)
    return len(routers)


def check_router_training(model: torch.nn.Module, train_router: bool, config: Any) -> str | None:
    """Check that the built model's routers train as ``moe.train_router`` says.

    Args:
        model: the built model (PEFT-wrapped or not).
        train_router: ``moe.train_router``.
        config: the transformers model config (``num_experts_per_tok``, ``norm_topk_prob``,
            ``output_router_logits``, ``router_aux_loss_coef``).

    Returns:
        A warning to log once where a trained router gets no gradient from the LM loss
        (`router_gradient_note`), else None.

    Raises:
        ValueError: routers that train although ``moe.train_router=false`` (``lora.modules_to_save``
            or a ``lora.init_from`` adapter names them), or that stay frozen although it is true (a
            ``lora.init_from`` adapter that does not save them), naming the keys to change.
    """
    routers = _routers(model)
    trained = sorted({_in_layer(name) for name, r in routers if any(p.requires_grad for p in r.parameters())})
    if trained and not train_router:
        raise ValueError(
            f"the MoE routers ({', '.join(trained)}) would train although moe.train_router=false: lora.modules_to_save "
            "(or the modules_to_save of the lora.init_from adapter) names them; set moe.train_router=true, or drop them "
            "from lora.modules_to_save"
        )
    if train_router and routers and not trained:
        raise ValueError(
            "moe.train_router=true, but the MoE routers stay frozen: the lora.init_from adapter does not save them "
            "(its modules_to_save lacks them); set moe.train_router=false to train that adapter on, or train a new one"
        )
    return router_gradient_note(config) if train_router else None


def router_gradient_note(config: Any) -> str | None:
    """Why a trained router gets no gradient from the LM loss, where the routing config says so; else None.

    With top-1 routing and normalised top-k weights (``num_experts_per_tok=1``,
    ``norm_topk_prob=true``) every token's one routing weight is ``p / p = 1`` whatever the router
    computes: the LM loss's gradient through the weights is zero (fp32 rounding leaves ~1e-10), and
    the expert choice (a top-k) has no gradient. Only the load-balancing loss then trains the router.
    """
    if getattr(config, "num_experts_per_tok", None) != 1 or not getattr(config, "norm_topk_prob", False):
        return None
    coef = aux_loss_coef(config)
    if coef:
        how = f"only the load-balancing loss (router_aux_loss_coef={coef}) trains it"
        fix = "set model.config.norm_topk_prob=false for the LM loss to train it too"
    else:
        how = "and the load-balancing loss is off, so nothing trains it"
        fix = (
            "set model.config.output_router_logits=true with model.config.router_aux_loss_coef > 0, "
            "or model.config.norm_topk_prob=false, or moe.train_router=false"
        )
    return (
        "moe.train_router=true with top-1 routing and normalised top-k weights (model.config.num_experts_per_tok=1, "
        f"norm_topk_prob=true): every routing weight is 1, so the LM loss gives the router no gradient; {how}. "
        f"To change that, {fix}"
    )


def aux_loss_coef(config: Any) -> float | None:
    """``router_aux_loss_coef`` where ``output_router_logits`` asks for the load-balancing loss, else None."""
    if not getattr(config, "output_router_logits", False):
        return None
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_loss_function(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """transformers' ``load_balancing_loss_func`` for ``model`` (a transformers causal LM): the one its
    modeling module defines and its ``forward`` calls.

    Raises:
        ValueError: the modeling module has none, naming ``model.config.output_router_logits``.
    """
    func = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if func is None:
        bias = any(hasattr(router, "e_score_correction_bias") for _, router in _routers(model))
        why = (
            " (its routers balance the experts with e_score_correction_bias, DeepSeek-V3's auxiliary-loss-free bias, "
            "which shifts the expert choice and is no trained weight: training leaves it as loaded)"
            if bias else ""
        )
        raise ValueError(
            f"model.config.output_router_logits=true: {type(model).__name__}'s module ({type(model).__module__}) has no "
            f"load_balancing_loss_func{why}, so there is no load-balancing loss to add; set model.config.output_router_logits=false"
        )
    return func


def load_balancing_loss(model: torch.nn.Module, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The load-balancing loss of one packed micro-batch, as ``model``'s forward computes its ``aux_loss``.

    Args:
        model: the transformers causal LM (not the PEFT wrapper): its ``num_experts`` and
            ``num_experts_per_tok``, as its forward passes them.
        router_logits: one [T, num_experts] tensor per MoE layer (transformers' ``router_logits`` output).

    Returns:
        A scalar fp32 tensor (the unscaled ``aux_loss``; the training loss adds ``router_aux_loss_coef`` times it).
    """
    return load_balancing_loss_function(model)(router_logits, model.num_experts, model.num_experts_per_tok, None)
