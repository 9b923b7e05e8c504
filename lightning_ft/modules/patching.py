"""Per-architecture patch tables: which HF module gets which fused forward, and how to undo it.

`apply_kernels(model, kernels)` swaps in the fused ops of `lightning_ft.kernels` where the table for
`model.config.model_type` says so; `revert_kernels(model)` puts stock HF back. With every kernel off
nothing is touched, so the model is stock HF + PEFT: the reference every speed-up is measured against.

What gets patched, per kernel switch:

    rms_norm  every instance of the table's RMSNorm classes (decoder norms, final norm, Qwen3's q/k
              norms): `forward` becomes `rms_norm(x, self.weight, self.variance_epsilon)`. And the
              table's decoder layers (pre-norm: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``)
              whose two norms are such instances, when the CUDA graphs run them
              (`lightning_ft.modules.cuda_graphs`, ``model.cuda_graphs=true``): each residual sum
              joins the norm that reads it (`residual_rms_norm`: the forward's ``x + attn`` is
              written as norm2 reads it, and each norm's backward adds the residual path's gradient
              into its own: two adds fewer per layer and pass); in the graphs' recompute the
              layer's last sum, whose value nobody reads, is not computed
              (`recomputing_for_backward`), and in a forward graph it lands in the graph's output
              buffer (`layer_output_buffer`). The same values and gradients as HF's forward; its
              code is followed line for line, the attention and the MLP are called as modules. It
              is an instance attribute the graphs call instead of the class's forward
              (`cuda_graphs.LAYER_FORWARD_ATTR`): every other caller, HF's own gradient
              checkpointing included, runs the stock forward.
    swiglu    every instance of the table's dense MLP classes: `forward` becomes
              `down_proj(swiglu(gate_proj(x), up_proj(x)))`. The projections are called as they are,
              so PEFT's LoRA layers on gate/up/down still apply. Qwen3-MoE's experts
              (`Qwen3MoeExperts`) are not touched here: MoE dispatch lives in modules/moe.py.
    rope      the module-level `apply_rotary_pos_emb` of the architecture's modeling file (HF's
              attention calls it by that global name), replaced by `apply_rope` (in place on q, k).
    lora      every PEFT `lora.Linear` (any architecture) with an adapter `lora_linear` computes
              exactly (`lora_linear_adapters`: no dropout, no DoRA, ...): `forward` becomes
              `lora_linear` whenever that adapter alone is active, enabled and not merged, and the
              call passes nothing but the input; PEFT's own forward otherwise, call by call. Those
              the table's ``kept_linears`` names may keep their output for the CUDA graphs'
              recompute (`lightning_ft.modules.kept`, kind ``projections``).

Module patches are per instance (an instance attribute `forward`, found by class, so a PEFT-wrapped
model works the same), and the instance's previous `forward` attribute, if it had one, is kept for
`revert_kernels`. The RoPE patch is process-wide for that architecture (a module attribute):
it is reference-counted across patched models and the stock function comes back when the last of
them is reverted. The `fused_linear_cross_entropy` switch is read by the LightningModule, not here.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from lightning_ft.kernels.lora import lora_linear, lora_linear_adapters
from lightning_ft.kernels.rms_norm import residual_rms_norm, rms_norm
from lightning_ft.kernels.rope import apply_rope
from lightning_ft.kernels.swiglu import swiglu
from lightning_ft.modules import kept
from lightning_ft.modules.cuda_graphs import LAYER_FORWARD_ATTR, layer_output_buffer, recomputing_for_backward

KERNEL_KEYS = ("rms_norm", "rope", "swiglu", "lora", "fused_linear_cross_entropy")
_SILU_ACTS = ("silu", "swish")
_RECORD_ATTR = "_lightning_ft_kernel_undo"


@dataclass(frozen=True)
class PatchTable:
    """Where one architecture keeps the pieces the kernels replace."""

    modeling_module: str  # defines the classes below and `apply_rotary_pos_emb`
    rms_norm: tuple[str, ...]
    mlp: tuple[str, ...]  # gated MLPs computing down_proj(act_fn(gate_proj(x)) * up_proj(x))
    # LoRA linear layers (by attribute name) whose output no op of the architecture changes in place:
    # the CUDA graphs may keep it for the recompute (`lightning_ft.modules.kept`). Not Llama's q/k:
    # its RoPE (ours) rotates them in place; Qwen3's q/k pass through q_norm/k_norm first.
    kept_linears: tuple[str, ...] = ()
    # pre-norm decoder layers (input_layernorm, self_attn, post_attention_layernorm, mlp) whose
    # forward is HF's two residual sums: their sums join the norms (the rms_norm switch)
    decoder_layers: tuple[str, ...] = ()


_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
PATCH_TABLES: dict[str, PatchTable] = {
    "llama": PatchTable(
        "transformers.models.llama.modeling_llama", ("LlamaRMSNorm",), ("LlamaMLP",), ("v_proj", "o_proj", *_MLP_LINEARS),
        ("LlamaDecoderLayer",),
    ),
    "qwen3": PatchTable(
        "transformers.models.qwen3.modeling_qwen3", ("Qwen3RMSNorm",), ("Qwen3MLP",),
        ("q_proj", "k_proj", "v_proj", "o_proj", *_MLP_LINEARS), ("Qwen3DecoderLayer",),
    ),
    "qwen3_moe": PatchTable(
        "transformers.models.qwen3_moe.modeling_qwen3_moe", ("Qwen3MoeRMSNorm",), ("Qwen3MoeMLP",),
        ("q_proj", "k_proj", "v_proj", "o_proj", *_MLP_LINEARS), ("Qwen3MoeDecoderLayer",),
    ),
}  # fmt: skip


def _fused_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _fused_swiglu_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _fused_lora_forward(self: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    active = self.active_adapters
    if args or kwargs or len(active) != 1 or self.disable_adapters or self.merged:
        return type(self).forward(self, x, *args, **kwargs)
    (name,) = active
    lora_A = self.lora_A[name]
    scaling = self.scaling[name]
    # an adapter checked at patch time (re-created under its name: a new lora_A module), a non-zero
    # scaling (PEFT's 0 · NaN stays NaN), and, without autocast, PEFT's dtype (it computes the
    # adapter in the adapter's dtype)
    ours = self._lightning_ft_lora.get(name) is lora_A and scaling != 0
    if not ours or (x.dtype != lora_A.weight.dtype and not torch.is_autocast_enabled(x.device.type)):
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    keep = kept.active("projections") if self._lightning_ft_keep else None
    if keep is not None and not _output_keepable(self):
        keep = None
    return lora_linear(x, base.weight, base.bias, lora_A.weight, self.lora_B[name].weight, scaling, keep=keep)


def _output_keepable(module: torch.nn.Module) -> bool:
    """Whether a kept output of this LoRA layer (`lightning_ft.modules.kept`) stays right, checked per call (the
    forward and its recompute decide alike): its base weight and bias frozen (the kept path computes no gradient
    for them) and no forward hook that could change the output in place (it is a view of the kept buffer)."""
    base = module.base_layer
    frozen = not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
    return frozen and not module._forward_hooks and not torch.nn.modules.module._global_forward_hooks


def _patch_lora(model: torch.nn.Module, undo: list[Callable[[], None]], kept_linears: tuple[str, ...]) -> int:
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for path, module in model.named_modules():
        if type(module) is LoraLinear and (adapters := lora_linear_adapters(module)):
            module._lightning_ft_lora = {name: module.lora_A[name] for name in adapters}  # a plain dict: not submodules
            module._lightning_ft_keep = path.rsplit(".", 1)[-1] in kept_linears  # its output may be kept
            undo.append(functools.partial(delattr, module, "_lightning_ft_lora"))
            undo.append(functools.partial(delattr, module, "_lightning_ft_keep"))
            _patch_forward(module, _fused_lora_forward, undo)
            count += 1
    return count


class _UnreadSum(torch.autograd.Function):
    """``a + b`` for autograd only: the forward returns an uninitialised tensor of the sum's shape
    and dtype (its value must not be read), the backward passes the gradient to both, as an add's."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.new_empty(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.promote_types(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad


_CACHE_KWARGS = ("cache", "past_key_values")


def _hooked(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` would run hooks (its own or global ones, forward or backward)."""
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    nn_module = torch.nn.modules.module
    global_hooks = (
        nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
        nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks,
    )  # fmt: skip
    return any(own) or any(global_hooks)


def _residual_norm_layer_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A pre-norm decoder layer's forward with each residual sum in its norm's kernel, for the CUDA
    graphs (`cuda_graphs.LAYER_FORWARD_ATTR`): HF's forward line for line, the attention and the MLP
    called as modules. HF's own forward (``type(self).forward``) runs instead for positional
    arguments, a cache, or a norm with hooks (calling the norm's module would run them)."""
    norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
    cached = kwargs.get("use_cache") or any(kwargs.get(name) is not None for name in _CACHE_KWARGS)
    if args or cached or _hooked(norm1) or _hooked(norm2):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    # HF: residual = x; x = norm1(x); x = attn(x); x = residual + x; residual = x; x = norm2(x)
    normed, residual = residual_rms_norm(hidden_states, norm1.weight, norm1.variance_epsilon)
    attn_out, _ = self.self_attn(hidden_states=normed, **kwargs)
    normed, residual = residual_rms_norm(attn_out, norm2.weight, norm2.variance_epsilon, residual=residual)
    mlp_out = self.mlp(normed)
    if recomputing_for_backward():  # the graphs' recompute differentiates through the sum, reads nothing
        return _UnreadSum.apply(residual, mlp_out)
    out = layer_output_buffer()  # a forward graph's recording: the sum straight into its output buffer
    if (out is not None and not torch.is_grad_enabled() and out.shape == residual.shape
            and out.dtype == torch.promote_types(residual.dtype, mlp_out.dtype)):  # fmt: skip
        return torch.add(residual, mlp_out, out=out)
    return residual + mlp_out


def _patch_decoder_layers(model: torch.nn.Module, classes: tuple[type, ...], norms: tuple[type, ...], undo: list) -> int:
    """Give the layers of ``classes`` whose two norms are of ``norms`` the residual-norm forward for the CUDA graphs."""
    count = 0
    for layer in model.modules():
        if (type(layer) in classes and isinstance(getattr(layer, "input_layernorm", None), norms)
                and isinstance(getattr(layer, "post_attention_layernorm", None), norms)):  # fmt: skip
            setattr(layer, LAYER_FORWARD_ATTR, _residual_norm_layer_forward)
            undo.append(functools.partial(delattr, layer, LAYER_FORWARD_ATTR))
            count += 1
    return count


def _fused_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for HF's apply_rotary_pos_emb: unsqueeze_dim=1 for [B, H, T, D], 2 for [B, T, H, D]."""
    if unsqueeze_dim == 1:
        return apply_rope(q, k, cos, sin)
    if unsqueeze_dim == 2:
        q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)
    raise ValueError(f"apply_rotary_pos_emb: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")


# modeling module name -> (stock apply_rotary_pos_emb, number of models that patched it)
_ROPE_PATCHES: dict[str, tuple[Callable, int]] = {}
_ABSENT = object()


def _hf_model(model: torch.nn.Module) -> PreTrainedModel:
    """The HF model inside `model` (itself, or the one a PeftModel wraps)."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"no transformers PreTrainedModel inside {type(model).__name__}")


def _restore_forward(module: torch.nn.Module, previous: object) -> None:
    if previous is _ABSENT:
        del module.forward
    else:
        module.forward = previous


def _patch_forwards(
    model: torch.nn.Module, classes: tuple[type, ...], fused: Callable, undo: list[Callable[[], None]]
) -> int:
    count = 0
    for module in model.modules():
        if isinstance(module, classes):
            _patch_forward(module, fused, undo)
            count += 1
    return count


def _patch_forward(module: torch.nn.Module, fused: Callable, undo: list[Callable[[], None]]) -> None:
    undo.append(functools.partial(_restore_forward, module, module.__dict__.get("forward", _ABSENT)))
    module.forward = types.MethodType(fused, module)


def _unpatch_rope(modeling: types.ModuleType) -> None:
    stock, users = _ROPE_PATCHES[modeling.__name__]
    if users == 1:
        modeling.apply_rotary_pos_emb = stock
        del _ROPE_PATCHES[modeling.__name__]
    else:
        _ROPE_PATCHES[modeling.__name__] = (stock, users - 1)


def _patch_rope(modeling: types.ModuleType, undo: list[Callable[[], None]]) -> None:
    stock, users = _ROPE_PATCHES.get(modeling.__name__, (modeling.apply_rotary_pos_emb, 0))
    _ROPE_PATCHES[modeling.__name__] = (stock, users + 1)
    modeling.apply_rotary_pos_emb = _fused_apply_rotary_pos_emb
    undo.append(functools.partial(_unpatch_rope, modeling))


def apply_kernels(model: torch.nn.Module, kernels: Mapping[str, bool]) -> list[str]:
    """Patch the fused kernels switched on in `kernels` into `model` (HF or PEFT-wrapped).

    `kernels` maps `rms_norm`, `rope`, `swiglu`, `lora` (and `fused_linear_cross_entropy`, ignored
    here) to bools; other keys are an error. A model patched before is reverted first. Returns one
    line per kernel applied, e.g. "rms_norm: 9 x LlamaRMSNorm".
    """
    unknown = sorted(set(kernels) - set(KERNEL_KEYS))
    if unknown:
        raise ValueError(f"unknown kernel switches {unknown}; the known ones are {list(KERNEL_KEYS)}")
    revert_kernels(model)
    wanted = {name for name in ("rms_norm", "rope", "swiglu", "lora") if kernels.get(name, False)}
    if not wanted:
        return []

    hf_model = _hf_model(model)
    undo: list[Callable[[], None]] = []
    applied = []
    setattr(hf_model, _RECORD_ATTR, undo)
    config = hf_model.config
    table = PATCH_TABLES.get(config.model_type)
    if "lora" in wanted:
        kept_linears = table.kept_linears if table is not None else ()
        applied.append(f"lora: {_patch_lora(hf_model, undo, kept_linears)} x peft lora.Linear")
        wanted.discard("lora")
        if not wanted:
            return applied
    if table is None:
        raise ValueError(
            f"no kernel patch table for model_type {config.model_type!r} (have {sorted(PATCH_TABLES)}); "
            "set every kernel switch to false (kernels=none) for this model"
        )
    if "swiglu" in wanted and config.hidden_act not in _SILU_ACTS:
        raise ValueError(f"the swiglu kernel needs hidden_act silu, {config.model_type} uses {config.hidden_act!r}")

    modeling = importlib.import_module(table.modeling_module)
    for name, class_names, fused in (
        ("rms_norm", table.rms_norm, _fused_rms_norm_forward),
        ("swiglu", table.mlp, _fused_swiglu_mlp_forward),
    ):
        if name in wanted:
            classes = tuple(getattr(modeling, c) for c in class_names)
            line = f"{name}: {_patch_forwards(hf_model, classes, fused, undo)} x {', '.join(class_names)}"
            if name == "rms_norm" and table.decoder_layers:
                layers = tuple(getattr(modeling, c) for c in table.decoder_layers)
                count = _patch_decoder_layers(hf_model, layers, classes, undo)
                line += f", the residual sums of {count} x {', '.join(table.decoder_layers)} (in the CUDA graphs)"
            applied.append(line)
    if "rope" in wanted:
        _patch_rope(modeling, undo)
        applied.append(f"rope: {table.modeling_module}.apply_rotary_pos_emb")
    return applied


def revert_kernels(model: torch.nn.Module) -> None:
    """Undo `apply_kernels` on `model` (HF or PEFT-wrapped); a no-op for a model never patched."""
    hf_model = _hf_model(model)
    for undo in reversed(hf_model.__dict__.pop(_RECORD_ATTR, [])):
        undo()
