"""Per-architecture patch tables: which HF module gets which fused forward, and how to undo it.

`apply_kernels(model, kernels)` swaps in the fused ops of `lightning_ft.kernels` where the table for
`model.config.model_type` says so; `revert_kernels(model)` puts stock HF back. With every kernel off
nothing is touched, so the model is stock HF + PEFT: the reference every speed-up is measured against.

What gets patched, per kernel switch:

    rms_norm  every instance of the table's RMSNorm classes (decoder norms, final norm, Qwen3's and
              Gemma 3's q/k norms): `forward` becomes `rms_norm(x, self.weight, self.variance_epsilon)`,
              or for a class in ``rms_norm_offsets`` (Gemma's ``(1 + weight)``, gpt-oss's scaled in
              fp32) `rms_norm(x, self.weight, eps, offset=..., fp32_scale=True)`.
    swiglu    every instance of the table's dense MLP classes, where the config's activation
              (``hidden_activation``, else ``hidden_act``) is one of `GLU_ACTIVATIONS`' names (SwiGLU,
              GeGLU): `forward` becomes `down_proj(swiglu(gate_proj(x), up_proj(x), activation))`, or
              with ``fused_gate_up`` (Phi-3's one ``gate_up_proj``, gate first)
              `down_proj(swiglu_concat(gate_up_proj(x), activation=...))`. The projections are called
              as they are, so PEFT's LoRA layers on them still apply. Routed experts (`Qwen3MoeExperts`, ...) are not touched here: MoE dispatch lives in model/moe.py;
              shared experts and dense layers of an MoE model are the table's MLP class.
    rope      the module-level `apply_rotary_pos_emb` of the architecture's modeling file (HF's
              attention calls it by that global name), replaced by `apply_rope` (in place on q, k);
              with ``rope_half_tables`` (gpt-oss: cos/sin of D/2 columns, each frequency once) the
              tables are repeated to D columns first.
    lora      every PEFT `lora.Linear` (and `lora.bnb.Linear4bit`: a 4-bit base, `qlora_linear`) (any
              architecture) with an adapter `lora_linear` computes
              exactly (`lora_linear_adapters`: no dropout, no DoRA, ...): `forward` becomes
              `lora_linear` whenever that adapter alone is active, enabled and not merged, and the
              call passes nothing but the input; PEFT's own forward otherwise, call by call
              (`lightning_ft.model.lora`). Those
              the table's ``kept_linears`` names may keep their output for the CUDA graphs'
              recompute (`lightning_ft.strategies.kept`: kind ``mlp`` for the MLPs' linear layers,
              `MLP_LINEARS`, ``projections`` for attention's).

    fp8       (no switch: with fp8 base weights, `lightning_ft.strategies.fp8`) the patched norms and
              SwiGLU MLPs whose output an fp8 GEMM reads also write that output's fp8 rows in the same
              kernel, so the GEMM quantises nothing (`_mark_fp8_row_producers`).

    moe       (the ``moe`` config group, `lightning_ft.model.moe.apply_moe`) every instance of the
              table's `MoEClasses` sparse block: routed once, experts through the chosen backend.

Attention needs no entry: it goes through transformers' attention-function registry for every
architecture that takes packed rows (`lightning_ft.model.attention`, `lightning_ft.model.support`).

An architecture without a table, or a piece its table leaves out (``stock``: why), runs that piece
as transformers does: `apply_kernels` says so in its lines instead of failing, so ``kernels=all``
works for any causal LM (LoRA and the chunked CE need no table). A table names a piece only where
its math was checked equal to transformers' (tests/model/test_families.py).

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

from lightning_ft.kernels.fp8 import attach_fp8_rows
from lightning_ft.kernels.rms_norm import rms_norm
from lightning_ft.kernels.rope import apply_rope
from lightning_ft.kernels.swiglu import swiglu, swiglu_concat
from lightning_ft.model.lora import _fused_lora_forward, fused_lora_classes, lora_linear_adapters

KERNEL_KEYS = ("rms_norm", "rope", "swiglu", "lora", "fused_linear_cross_entropy")
# transformers' ACT2FN name -> the `swiglu` kernel's activation computing it (tests/model/test_patching.py checks each)
GLU_ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
}  # fmt: skip
_RECORD_ATTR = "_lightning_ft_kernel_undo"
_FP8_ROWS_ATTR = "_lightning_ft_fp8_rows"  # on a patched module: its kernel also writes its output's fp8 rows


@dataclass(frozen=True)
class MoEClasses:
    """An architecture's sparse MoE classes, whose blocks `lightning_ft.model.moe.apply_moe` patches."""

    sparse_block: str  # forward([..., D]) -> [..., D]; holds ``gate`` (the router), ``experts`` and any ``shared_experts``
    router: str  # the top-k router: its weight is frozen unless ``moe.train_router``
    decoder_layer: str  # returns ``residual + mlp(...)``: its ``mlp`` output feeds only that sum
    router_kind: str = "softmax_topk"  # the router's math: a key of `lightning_ft.kernels.moe.routing.ROUTER_KINDS`
    router_attr: str = "gate"  # the sparse block's attribute holding the router
    returns_router_scores: bool = False  # the block returns (hidden, router_scores) (gpt-oss), not hidden alone


@dataclass(frozen=True)
class PatchTable:
    """Where one architecture keeps the pieces the kernels (and, for an MoE model, the MoE backends) replace."""

    modeling_module: str  # defines the classes below and `apply_rotary_pos_emb`
    rms_norm: tuple[str, ...]
    mlp: tuple[str, ...]  # gated MLPs computing down_proj(act_fn(gate_proj(x)) * up_proj(x))
    # LoRA linear layers (by attribute name) whose output no op of the architecture changes in place:
    # the CUDA graphs may keep it for the recompute (`lightning_ft.strategies.kept`). Not Llama's q/k:
    # its RoPE (ours) rotates them in place; Qwen3's q/k pass through q_norm/k_norm first.
    kept_linears: tuple[str, ...] = ()
    moe: MoEClasses | None = None  # the MoE block's classes (`lightning_ft.model.moe`); None: a dense model
    fused_gate_up: bool = False  # the MLPs compute down_proj(act(gate) * up) from one gate_up_proj ([gate | up])
    stock: tuple[tuple[str, str], ...] = ()  # (kernel switch, why it runs as transformers does) for pieces left out
    # (class of rms_norm, weight offset): norms computing (x * rstd * (offset + weight)) in fp32, rounded
    # once to x's dtype (Gemma's, eps in ``self.eps``; gpt-oss's, offset 0); the others are Llama's
    rms_norm_offsets: tuple[tuple[str, float], ...] = ()
    rope_half_tables: bool = False  # apply_rotary_pos_emb gets cos/sin of D_rot/2 columns (gpt-oss), not D_rot


_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
#: the linear layers of the MLPs (dense, shared experts; Phi-3's fused gate_up_proj) by attribute name: their kept
#: outputs are the ``mlp`` kind (`lightning_ft.strategies.kept`), the other kept linear layers' ``projections``
MLP_LINEARS = (*_MLP_LINEARS, "gate_up_proj")
_MLA_ROPE = ("rope", "MLA rotates a slice of q and k (interleaved with rope_interleave), which our in-place RoPE does not take")
PATCH_TABLES: dict[str, PatchTable] = {
    "llama": PatchTable(
        "transformers.models.llama.modeling_llama", ("LlamaRMSNorm",), ("LlamaMLP",), ("v_proj", "o_proj", *_MLP_LINEARS)
    ),
    # q/k/v carry biases (frozen, added by the base layer); windows per layer_types, through attention
    "qwen2": PatchTable(
        "transformers.models.qwen2.modeling_qwen2", ("Qwen2RMSNorm",), ("Qwen2MLP",), ("v_proj", "o_proj", *_MLP_LINEARS)
    ),
    # sliding_window (when set) on every layer, through attention
    "mistral": PatchTable(
        "transformers.models.mistral.modeling_mistral", ("MistralRMSNorm",), ("MistralMLP",),
        ("v_proj", "o_proj", *_MLP_LINEARS),
    ),
    # one qkv_proj (rotated in place by our RoPE: not kept) and one gate_up_proj; partial rotary allowed
    "phi3": PatchTable(
        "transformers.models.phi3.modeling_phi3", ("Phi3RMSNorm",), ("Phi3MLP",), ("o_proj", "gate_up_proj", "down_proj"),
        fused_gate_up=True,
    ),
    # two RoPE bases (sliding / full layers) reach apply_rotary_pos_emb as cos/sin tables; norms scale by
    # (1 + weight); the MLP is GeGLU (gelu_pytorch_tanh); q/k pass through q_norm/k_norm first
    "gemma3_text": PatchTable(
        "transformers.models.gemma3.modeling_gemma3", ("Gemma3RMSNorm",), ("Gemma3MLP",),
        ("q_proj", "k_proj", "v_proj", "o_proj", *_MLP_LINEARS), rms_norm_offsets=(("Gemma3RMSNorm", 1.0),),
    ),
    "qwen3": PatchTable(
        "transformers.models.qwen3.modeling_qwen3", ("Qwen3RMSNorm",), ("Qwen3MLP",),
        ("q_proj", "k_proj", "v_proj", "o_proj", *_MLP_LINEARS),
    ),
    "qwen3_moe": PatchTable(
        "transformers.models.qwen3_moe.modeling_qwen3_moe", ("Qwen3MoeRMSNorm",), ("Qwen3MoeMLP",),
        ("q_proj", "k_proj", "v_proj", "o_proj", *_MLP_LINEARS),
        moe=MoEClasses("Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeDecoderLayer"),
    ),
    # every MLP is an expert block (no dense MLP); router_jitter_noise applied as transformers does
    "mixtral": PatchTable(
        "transformers.models.mixtral.modeling_mixtral", ("MixtralRMSNorm",), (), ("v_proj", "o_proj"),
        moe=MoEClasses("MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralDecoderLayer"),
        stock=(("swiglu", "no dense MLP: the experts' SwiGLU runs in the MoE backend (the moe group)"),),
    ),
    # the first first_k_dense_replace layers dense (Glm4MoeMLP, also the shared experts); partial rotary
    "glm4_moe": PatchTable(
        "transformers.models.glm4_moe.modeling_glm4_moe", ("Glm4MoeRMSNorm",), ("Glm4MoeMLP",),
        ("v_proj", "o_proj", *_MLP_LINEARS),
        moe=MoEClasses("Glm4MoeMoE", "Glm4MoeTopkRouter", "Glm4MoeDecoderLayer", router_kind="sigmoid_grouped"),
    ),
    # MLA attention stays transformers' (its RoPE included); the MoE as GLM-4.5's
    "deepseek_v3": PatchTable(
        "transformers.models.deepseek_v3.modeling_deepseek_v3", ("DeepseekV3RMSNorm",), ("DeepseekV3MLP",),
        ("o_proj", *_MLP_LINEARS),
        moe=MoEClasses("DeepseekV3MoE", "DeepseekV3TopkRouter", "DeepseekV3DecoderLayer", router_kind="sigmoid_grouped"),
        stock=(_MLA_ROPE,),
    ),
    # GLM-4.7-Flash: DeepSeek-V3's MLA (attention and RoPE stay transformers') and MoE; sparse layers per mlp_layer_types
    "glm4_moe_lite": PatchTable(
        "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite", ("Glm4MoeLiteRMSNorm",), ("Glm4MoeLiteMLP",),
        ("o_proj", *_MLP_LINEARS),
        moe=MoEClasses("Glm4MoeLiteMoE", "Glm4MoeLiteTopkRouter", "Glm4MoeLiteDecoderLayer", router_kind="sigmoid_grouped"),
        stock=(_MLA_ROPE,),
    ),
    # every MLP is an expert block: transposed weights, interleaved gate/up, biases, clamped SwiGLU (the moe
    # group); router = linear with bias, softmax over the top-k logits; sliding windows on alternating layers
    # and attention sinks through attention; norms scale in fp32 (weights kept fp32); yarn RoPE, half tables
    "gpt_oss": PatchTable(
        "transformers.models.gpt_oss.modeling_gpt_oss", ("GptOssRMSNorm",), (), ("v_proj", "o_proj"),
        moe=MoEClasses(
            "GptOssMLP", "GptOssTopKRouter", "GptOssDecoderLayer", router_kind="topk_softmax", router_attr="router",
            returns_router_scores=True,
        ),
        stock=(("swiglu", "no dense MLP: the experts' clamped SwiGLU runs in the MoE backend (the moe group)"),),
        rms_norm_offsets=(("GptOssRMSNorm", 0.0),), rope_half_tables=True,
    ),
}  # fmt: skip


def has_moe_path(model_type: str | None) -> bool:
    """Whether ``model_type``'s patch table routes its experts through our MoE path (False: a dense model, or none)."""
    table = PATCH_TABLES.get(model_type or "")
    return table is not None and table.moe is not None


def moe_spec(block: torch.nn.Module) -> MoEClasses | None:
    """The `MoEClasses` of the table whose sparse block class ``block`` is an instance of (None: no table's)."""
    for table in PATCH_TABLES.values():
        if table.moe is not None:
            if isinstance(block, getattr(importlib.import_module(table.modeling_module), table.moe.sparse_block)):
                return table.moe
    return None


def moe_classes(role: str) -> tuple[type, ...]:
    """The classes of every table's `MoEClasses` in ``role`` (``sparse_block``, ``router`` or ``decoder_layer``)."""
    return tuple(
        getattr(importlib.import_module(table.modeling_module), getattr(table.moe, role))
        for table in PATCH_TABLES.values()
        if table.moe is not None
    )


def _with_fp8_rows(module: torch.nn.Module, op: Callable, *args, **kwargs) -> torch.Tensor:
    """``op(*args, **kwargs)``; for a module `_mark_fp8_row_producers` marked, with the output's fp8 rows
    from the same kernel left on it for the fp8 GEMM that reads it (`lightning_ft.kernels.fp8.attach_fp8_rows`)."""
    if not getattr(module, _FP8_ROWS_ATTR, False):
        return op(*args, **kwargs)
    y, q, scale = op(*args, fp8_rows=True, **kwargs)
    return attach_fp8_rows(y, (q, scale))


def _fused_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _with_fp8_rows(self, rms_norm, hidden_states, self.weight, self.variance_epsilon)


def _fused_offset_rms_norm_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, *, offset: float
) -> torch.Tensor:
    eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps  # gpt-oss's name, Gemma's
    return _with_fp8_rows(self, rms_norm, hidden_states, self.weight, eps, offset=offset, fp32_scale=True)


def _fused_swiglu_mlp_forward(self: torch.nn.Module, x: torch.Tensor, *, activation: str) -> torch.Tensor:
    return self.down_proj(_with_fp8_rows(self, swiglu, self.gate_proj(x), self.up_proj(x), activation))


def _fused_gate_up_mlp_forward(self: torch.nn.Module, x: torch.Tensor, *, activation: str) -> torch.Tensor:
    gate_up = self.gate_up_proj(x)
    return self.down_proj(swiglu_concat(gate_up.flatten(0, -2), activation=activation).view(*gate_up.shape[:-1], -1))


def _mlp_activation(config: object) -> object:
    """The activation name a gated MLP of ``config`` applies: ``hidden_activation`` (Gemma's), else ``hidden_act``."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def _fused_forwards(name: str, table: PatchTable, config: object) -> dict[str, Callable]:
    """Class name -> the fused forward that kernel switch ``name`` (rms_norm or swiglu) patches into its instances."""
    if name == "rms_norm":
        offsets = dict(table.rms_norm_offsets)
        return {
            c: functools.partial(_fused_offset_rms_norm_forward, offset=offsets[c]) if c in offsets
            else _fused_rms_norm_forward
            for c in table.rms_norm
        }  # fmt: skip
    mlp = _fused_gate_up_mlp_forward if table.fused_gate_up else _fused_swiglu_mlp_forward
    return dict.fromkeys(table.mlp, functools.partial(mlp, activation=GLU_ACTIVATIONS[_mlp_activation(config)]))


# decoder norm (attribute name) -> the sibling module whose fp8 GEMMs read its output; a layer with a
# pre_feedforward_layernorm (Gemma 3's) normalises the MLP's input there, its post_attention_layernorm
# the attention's output
_NORM_CONSUMERS = {"input_layernorm": "self_attn", "post_attention_layernorm": "mlp", "pre_feedforward_layernorm": "mlp"}


def _mark_fp8_row_producers(model: torch.nn.Module, undo: list[Callable[[], None]]) -> int:
    """Mark the patched kernels whose output an fp8 GEMM reads (`lightning_ft.strategies.fp8.Fp8Linear` bases) to
    emit its fp8 rows too (`_with_fp8_rows`): a decoder norm before attention or the MLP holding such a layer
    (Llama's input_layernorm / post_attention_layernorm, Gemma 3's pre_feedforward_layernorm), and a SwiGLU MLP
    whose down projection is one. Returns the number marked."""
    from lightning_ft.strategies.fp8 import Fp8Linear

    def holds_fp8(module: torch.nn.Module | None) -> bool:
        return module is not None and any(isinstance(m, Fp8Linear) for m in module.modules())

    marked = []
    for layer in model.modules():
        for norm_name, consumer in _NORM_CONSUMERS.items():
            norm = getattr(layer, norm_name, None)
            if norm_name == "post_attention_layernorm" and hasattr(layer, "pre_feedforward_layernorm"):
                continue
            if norm is not None and norm.__dict__.get("forward") is not None and holds_fp8(getattr(layer, consumer, None)):
                marked.append(norm)
        down, forward = getattr(layer, "down_proj", None), layer.__dict__.get("forward")
        fused = getattr(getattr(forward, "__func__", None), "func", None)  # the method's functools.partial's function
        if fused is _fused_swiglu_mlp_forward and holds_fp8(down):
            marked.append(layer)
    for module in marked:
        setattr(module, _FP8_ROWS_ATTR, True)
        undo.append(functools.partial(delattr, module, _FP8_ROWS_ATTR))
    return len(marked)


def _patch_lora(model: torch.nn.Module, undo: list[Callable[[], None]], kept_linears: tuple[str, ...]) -> int:
    classes = fused_lora_classes()
    count = 0
    for path, module in model.named_modules():
        if type(module) in classes and (adapters := lora_linear_adapters(module)):
            module._lightning_ft_lora = {name: module.lora_A[name] for name in adapters}  # a plain dict: not submodules
            name = path.rsplit(".", 1)[-1]  # its output may be kept, as this kind (None: never)
            module._lightning_ft_keep = ("mlp" if name in MLP_LINEARS else "projections") if name in kept_linears else None
            undo.append(functools.partial(delattr, module, "_lightning_ft_lora"))
            undo.append(functools.partial(delattr, module, "_lightning_ft_keep"))
            _patch_forward(module, _fused_lora_forward, undo)
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


def _fused_apply_rotary_pos_emb_half_tables(q, k, cos, sin, unsqueeze_dim=1):
    """`_fused_apply_rotary_pos_emb` for tables of D_rot/2 columns, each frequency once (gpt-oss's:
    ``out1 = x1 cos - x2 sin``, ``out2 = x2 cos + x1 sin``, the same rotation): repeated to D_rot."""
    return _fused_apply_rotary_pos_emb(q, k, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1), unsqueeze_dim)


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


def restore_instance_attr(module: torch.nn.Module, name: str, previous: object | None) -> None:
    """Remove the instance attribute ``name`` a patch set on ``module`` and put back ``previous``, the
    instance attribute it replaced (None: there was none, so the class's shows again)."""
    delattr(module, name)
    if previous is not None:
        setattr(module, name, previous)


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


def _patch_rope(modeling: types.ModuleType, undo: list[Callable[[], None]], half_tables: bool) -> None:
    stock, users = _ROPE_PATCHES.get(modeling.__name__, (modeling.apply_rotary_pos_emb, 0))
    _ROPE_PATCHES[modeling.__name__] = (stock, users + 1)
    modeling.apply_rotary_pos_emb = _fused_apply_rotary_pos_emb_half_tables if half_tables else _fused_apply_rotary_pos_emb
    undo.append(functools.partial(_unpatch_rope, modeling))


def apply_kernels(model: torch.nn.Module, kernels: Mapping[str, bool]) -> list[str]:
    """Patch the fused kernels switched on in `kernels` into `model` (HF or PEFT-wrapped).

    `kernels` maps `rms_norm`, `rope`, `swiglu`, `lora` (and `fused_linear_cross_entropy`, ignored
    here) to bools; other keys are an error. A model patched before is reverted first. Returns one
    line per kernel switched on: what it patched, e.g. "rms_norm: 9 x LlamaRMSNorm", or why that
    piece runs as transformers does, e.g. "swiglu: stock (no patch table for model_type 'gpt2')".

    Raises:
        ValueError: an unknown switch.
    """
    unknown = sorted(set(kernels) - set(KERNEL_KEYS))
    if unknown:
        raise ValueError(f"unknown kernel switches {unknown}; the known ones are {list(KERNEL_KEYS)}")
    revert_kernels(model)
    wanted = [name for name in ("lora", "rms_norm", "swiglu", "rope") if kernels.get(name, False)]
    if not wanted:
        return []

    hf_model = _hf_model(model)
    undo: list[Callable[[], None]] = []
    setattr(hf_model, _RECORD_ATTR, undo)
    config = hf_model.config
    table = PATCH_TABLES.get(config.model_type)
    stock = _stock_reasons(config, table)
    modeling = importlib.import_module(table.modeling_module) if table is not None else None
    applied = []
    for name in wanted:
        if name in stock:
            applied.append(f"{name}: stock ({stock[name]})")
        elif name == "lora":
            kept_linears = table.kept_linears if table is not None else ()
            applied.append(f"lora: {_patch_lora(hf_model, undo, kept_linears)} x peft lora.Linear")
        elif name == "rope":
            _patch_rope(modeling, undo, table.rope_half_tables)
            applied.append(f"rope: {table.modeling_module}.apply_rotary_pos_emb")
        else:
            fused = _fused_forwards(name, table, config)
            count = sum(_patch_forwards(hf_model, (getattr(modeling, c),), f, undo) for c, f in fused.items())
            applied.append(f"{name}: {count} x {', '.join(fused)}")
    if marked := _mark_fp8_row_producers(hf_model, undo):
        applied.append(f"fp8: {marked} x rms_norm / swiglu also write their output's fp8 rows for the next GEMM")
    return applied


def _stock_reasons(config: object, table: PatchTable | None) -> dict[str, str]:
    """Kernel switch -> why that piece runs as transformers does for ``config``'s architecture (``lora`` never)."""
    if table is None:
        why = f"no patch table for model_type {config.model_type!r}; tables exist for {sorted(PATCH_TABLES)}"
        return dict.fromkeys(("rms_norm", "swiglu", "rope"), why)
    reasons = dict(table.stock)
    if "swiglu" not in reasons and _mlp_activation(config) not in GLU_ACTIVATIONS:
        reasons["swiglu"] = f"the MLP's activation {_mlp_activation(config)!r} is none of {sorted(GLU_ACTIVATIONS)}"
    return reasons


def revert_kernels(model: torch.nn.Module) -> None:
    """Undo `apply_kernels` on `model` (HF or PEFT-wrapped); a no-op for a model never patched."""
    hf_model = _hf_model(model)
    for undo in reversed(hf_model.__dict__.pop(_RECORD_ATTR, [])):
        undo()
