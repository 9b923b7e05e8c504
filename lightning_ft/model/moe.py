"""Patch transformers' sparse MoE blocks with sync-free routing, grouped experts and split LoRA.

`apply_moe` replaces, per instance and reversibly (`revert_moe`), the forward of every sparse MoE
block that a patch table names (`lightning_ft.model.patching.MoEClasses`: Qwen3-MoE's
``Qwen3MoeSparseMoeBlock``, Mixtral's ``MixtralSparseMoeBlock``, GLM-4.5's ``Glm4MoeMoE``,
DeepSeek-V3's ``DeepseekV3MoE``, gpt-oss's ``GptOssMLP``); the classes, the router and the weights are
untouched. Shape suffixes as in `lightning_ft.kernels.moe`: T tokens, K top_k, E experts, D hidden.

Patched block forward, once per layer:

    router_logits_TE, topk_weight_TK, topk_idx_TK = self.gate(x_TD)   # HF's router, a module call
    routing = sort_by_expert(topk_idx_TK, E)                          # stable sort, int32 offsets
    out_TD  = moe_experts(x_TD, topk_weight_TK, routing, W_gate_up, W_down, act, LoRA..., backend)
    out_TD += self.shared_experts(x_TD)                               # GLM-4.5 / DeepSeek-V3 only

gpt-oss's block holds its router as ``self.router`` and returns ``(out, topk_weight_TK)``, as its
stock forward does (`MoEClasses.router_attr`, ``returns_router_scores``). Its experts are of the other
layout the backends take (transformers' ``is_concatenated=False, is_transposed=True, has_bias=True``):
their [E, D, 2I] / [E, I, D] weights go in as transposed views (no copy), the activation is
`lightning_ft.kernels.moe.ClampedSwiGLU` (the experts' ``alpha`` and ``limit``) on interleaved gate/up
columns, and ``gate_up_proj_bias`` / ``down_proj_bias`` are added per expert. PEFT's split LoRA on such
a transposed weight [E, C, N] has the same A [E*R, C] / B [N, R*E] factors as on [E, N, C]
(``ParamWrapper`` swaps in and out only for the untransposed layout), so `ExpertLoRA` reads it as is.

Mixtral's ``router_jitter_noise`` (training only) scales the block's input by the same uniform draw
as transformers' block. The first ``first_k_dense_replace`` layers of GLM-4.5 / DeepSeek-V3 hold a
dense MLP, not a sparse block: the ``swiglu`` kernel's, like the shared experts.

In the CUDA graphs' recompute of a decoder layer (`lightning_ft.strategies.recompute.recomputing_for_backward`) the output of a block
that is its decoder layer's ``mlp`` (the table's ``decoder_layer``) only feeds the layer's residual sum, whose value nobody
reads: ``output_needed=False`` skips the down projection and the un-permute there (their backward
needs neither). A block used anywhere else always computes its output.

Token chunks (``moe.chunk_tokens``, `lightning_ft.kernels.moe.token_chunks`): the experts of a row longer than the
chunk run over its tokens in chunks, each routed on its own, so one chunk's [T_chunk * K, ·] tensors are alive at a
time instead of the whole row's (gpt-oss-20b at 256K tokens: 11.25 GiB of gate/up output per layer, ~34 GiB of
backward working set). ``auto`` chunks a forward without grad and a checkpointed layer's forward and recompute (the
CUDA graphs' or ``torch.utils.checkpoint``'s, `lightning_ft.strategies.recompute`). For the block that is its
checkpointed layer's ``mlp`` the recompute's output is unread, so the recompute computes nothing and the backward runs
the experts chunk by chunk, once: no extra compute. A block elsewhere computes its output in the recompute too (one
more forward of the experts). A chunked block keeps nothing, whatever the memory plan chose for ``mlp``.

Kept projections (CUDA graphs' ``keep_projections``, `lightning_ft.strategies.kept`, kind ``mlp``): in a recorded
layer's forward the block keeps the experts' gate/up output (split LoRA added) and its thin LoRA
product, and the recompute reuses them, skipping the gate/up GEMM (at 8K tokens on Qwen3-30B-A3B,
65 536 routed rows × 2048 × 1536: 0.4 TFLOP per layer-step) and the gather of the tokens into
expert order (a 256 MiB copy: the LoRA A gradient reads the tokens through the routing instead)
for 194 MiB per layer (of the 306 MiB such a layer keeps with its q/k/v/o outputs). The recompute
routes again (the same kernels on the same input: the same order), so the kept rows line up.
``grouped_mm`` backend only; the others recompute (their forward offers nothing to keep).

Router logits: transformers v5 collects ``output_router_logits`` with forward hooks that its
``capture_outputs`` decorator installs on every router (``Qwen3MoeTopKRouter``, ...; ``OutputRecorder(index=0)``).
The patched block calls ``self.gate`` as a module, exactly as the stock block does, so the hooks fire
and the load-balancing loss (``router_aux_loss_coef``) sees what the installed transformers records.
Note: the router itself is left stock on purpose. Its math (the table's ``router_kind``:
`topk_routing` or `grouped_topk_routing`, tested equal) is already sync-free, and what its first output holds has differed across
transformers 5.x releases (some returned the softmax probabilities there), so keeping HF's module
keeps the aux loss identical to stock on every version (and DeepSeek-V3's ``e_score_correction_bias``
where transformers keeps it). Only its ``torch.topk`` calls on [T, E] rows are served by our
kernel (`lightning_ft.kernels.moe.routing.topk`, through a torch function mode around the call: the
same experts and weights; torch's radix select took ~60 µs per call at 8K tokens on the H200). Whether
the router trains is the model builder's business (`lightning_ft.model.router`, ``moe.train_router``):
the block calls whatever module ``gate`` is, PEFT's ``modules_to_save`` wrapper around a trained
router included.

Split LoRA: with ``LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])`` PEFT nests two ``ParamWrapper`` modules around the experts and, in its
own forward, adds ``scaling * B_e A_e`` to every expert's weight each step. The patched block never
calls those wrappers: it reads their ``lora_A``/``lora_B`` weights (`ExpertLoRA`) and applies LoRA per
routed token, so the gradients land in PEFT's own parameters and ``save_pretrained`` writes PEFT's
adapter file. PEFT's adapter state is honoured: disabled adapters (``disable_adapter()``) or merged
weights mean no LoRA term, as in PEFT's forward.

LoRA slots (``moe.lora_slots``, grouped_mm): `augment_expert_weights` lays each frozen expert weight
with split LoRA out inside a tensor with R spare rows and columns, where the backend copies the
factors right before the GEMMs that read them, so that LoRA joins the expert GEMMs along K instead
of a pass of its own.

Order: either order with ``get_peft_model`` works; the LoRA is looked up per forward.

Sources: transformers v5 ``models/qwen3_moe/modeling_qwen3_moe.py``, ``models/mixtral/modeling_mixtral.py``,
``models/glm4_moe/modeling_glm4_moe.py``, ``models/deepseek_v3/modeling_deepseek_v3.py``,
``models/gpt_oss/modeling_gpt_oss.py``, ``utils/output_capturing.py``;
PEFT 0.21 ``tuners/lora/layer.py`` (``ParamWrapper``).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch
from peft.tuners.lora.layer import ParamWrapper
from peft.tuners.tuners_utils import BaseTunerLayer

from lightning_ft.kernels.moe import ClampedSwiGLU, ExpertBiases, ExpertLoRA, moe_experts, select_backend, sort_by_expert
from lightning_ft.kernels.moe.grouped_mm import augment_expert_weight, padded_rank
from lightning_ft.kernels.moe.routing import topk
from lightning_ft.kernels.moe.token_chunks import auto_chunk_tokens, moe_experts_in_chunks
from lightning_ft.model.mxfp4 import mxfp4_weight
from lightning_ft.model.nf4_experts import nf4_weight
from lightning_ft.model.patching import moe_classes, moe_spec, restore_instance_attr
from lightning_ft.strategies import kept
from lightning_ft.strategies.recompute import checkpoint_pass, checkpointed_layer, recomputing_for_backward
from lightning_ft.strategies.fp8 import convert_expert_weight, fp8_expert_weight, fp8_experts_blocker

__all__ = ["apply_moe", "augment_expert_weights", "check_chunk_tokens", "convert_experts_to_fp8", "revert_moe"]

logger = logging.getLogger(__name__)

_BACKEND_ATTR = "_lightning_ft_moe_backend"
_PREVIOUS_FORWARD_ATTR = "_lightning_ft_moe_previous_forward"  # the block's instance `forward`, or None
_FEEDS_RESIDUAL_ATTR = "_lightning_ft_moe_feeds_residual"  # the block is its decoder layer's mlp
_SPEC_ATTR = "_lightning_ft_moe_spec"  # the block's `MoEClasses`
_CHUNK_ATTR = "_lightning_ft_moe_chunk_tokens"  # ``moe.chunk_tokens``: "auto", a token count, or None

_DEFAULT_LAYOUT = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True}
_GPT_OSS_LAYOUT = {"is_concatenated": False, "is_transposed": True, "has_bias": True, "has_gate": True}


def _experts_layout(experts: torch.nn.Module) -> dict[str, bool]:
    """The experts' layout flags (transformers' ``use_experts_implementation``): the default or gpt-oss's.

    Raises:
        ValueError: any other layout, or gpt-oss's without the clamped SwiGLU's ``alpha`` and ``limit``.
    """
    layout = {name: getattr(experts, name, default) for name, default in _DEFAULT_LAYOUT.items()}
    if layout == _GPT_OSS_LAYOUT and hasattr(experts, "alpha") and hasattr(experts, "limit"):
        return layout
    if layout != _DEFAULT_LAYOUT:
        raise ValueError(
            f"unsupported experts layout {layout}; split LoRA and the backends take {_DEFAULT_LAYOUT} or gpt-oss's "
            f"{_GPT_OSS_LAYOUT} (with the clamped SwiGLU's alpha and limit)"
        )
    return layout


def _expert_math(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, Callable, ExpertBiases]:
    """(w_gate_up_EFD, w_down_EDI, act_fn, biases) of an experts module as `moe_experts` takes them:
    a transposed layout's weights as transposed views (MXFP4 ones, ``model.quantization=mxfp4``, as the
    `lightning_ft.kernels.mxfp4.Mxfp4Weight` of their buffers; NF4 ones, ``model.quantization=nf4`` on the
    triton or grouped_mm backend, as the `lightning_ft.kernels.nf4.Nf4ExpertWeight` of theirs; fp8 ones (``strategy.fp8``) as
    their `lightning_ft.kernels.fp8.Fp8ExpertWeight`); gpt-oss's activation and biases."""
    transposed = _experts_layout(experts)["is_transposed"]  # gpt-oss's

    def weight(name):
        for quantised in (mxfp4_weight(experts, name), fp8_expert_weight(experts, name)):  # in the math's layout
            if quantised is not None:
                return quantised
        stored = nf4_weight(experts, name)  # in the stored layout, like the parameter
        stored = stored if stored is not None else getattr(experts, name)
        return stored.transpose(1, 2) if transposed else stored

    gate_up, down = weight("gate_up_proj"), weight("down_proj")
    if transposed:
        return gate_up, down, ClampedSwiGLU(alpha=experts.alpha, limit=experts.limit), \
            ExpertBiases(experts.gate_up_proj_bias, experts.down_proj_bias)
    return gate_up, down, experts.act_fn, ExpertBiases()


def check_chunk_tokens(value) -> str | int | None:
    """``moe.chunk_tokens`` as the blocks take it: ``"auto"``, a positive token count, or None (never chunked).

    Raises:
        ValueError: any other value, naming the key.
    """
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(
        f"moe.chunk_tokens={value!r}: expected auto, a positive number of tokens (e.g. 32768) or null (never chunked)"
    )


def _chunk_tokens(option: str | int | None, top_k: int, w_gate_up_EFD, checkpointed: bool) -> int | None:
    """The tokens per chunk of a block's experts under ``option`` (`check_chunk_tokens`), or None: unchunked.

    ``auto`` chunks a forward without grad and a ``checkpointed`` layer's forward and recompute
    (`lightning_ft.strategies.recompute`; for the layer's own ``mlp`` block the recompute's output is unread, so the
    chunks' backward runs the experts once: `lightning_ft.kernels.moe.token_chunks`); its size is `auto_chunk_tokens`
    of the gate/up output. A number chunks every forward (outside a checkpointed layer, with grad, the backward runs
    the experts' forward once more).
    """
    if option != "auto":
        return option
    if torch.is_grad_enabled() and not checkpointed:
        return None
    return auto_chunk_tokens(top_k, w_gate_up_EFD.shape[1], w_gate_up_EFD.dtype.itemsize)


def apply_moe(model: torch.nn.Module, backend: str = "auto", chunk_tokens: str | int | None = "auto") -> str:
    """Patch every sparse MoE block a patch table names in ``model`` (plain or PEFT-wrapped) to our MoE path.

    Calling it again re-patches with the new settings.

    Args:
        model: a transformers model, a PEFT model around one, or a bare sparse block.
        backend: ``auto``, ``native_torch``, ``grouped_mm`` or ``triton`` (``moe.backend``); ``auto``
            is ``grouped_mm`` on a CUDA GPU with a native grouped kernel, else ``native_torch``.
        chunk_tokens: ``moe.chunk_tokens`` (`check_chunk_tokens`): the experts of rows longer than this many
            tokens run in chunks of it (`_chunk_tokens`).

    Returns:
        The backend in use.

    Raises:
        ValueError: no sparse MoE block a patch table names (`MoEClasses`) in ``model``, an unknown backend, or experts in a
            layout other than transformers' default (concatenated gate/up, not transposed, no bias) or
            gpt-oss's (`_GPT_OSS_LAYOUT`).
        RuntimeError: the backend cannot run here (see `select_backend`).
    """
    chunk_tokens = check_chunk_tokens(chunk_tokens)
    sparse_blocks = moe_classes("sparse_block")
    blocks = [m for m in model.modules() if isinstance(m, sparse_blocks)]
    if not blocks:
        names = ", ".join(c.__name__ for c in sparse_blocks)
        raise ValueError(
            f"{type(model).__name__} has no sparse MoE block ({names}); apply_moe patches the MoE architectures "
            "of lightning_ft.model.patching.PATCH_TABLES only (moe=hf leaves the MoE path stock)"
        )
    for block in blocks:
        _experts_layout(_experts_and_lora(block.experts)[0])
    chosen = select_backend(backend)
    for block in blocks:
        if not hasattr(block, _BACKEND_ATTR):  # a re-patch must not record our own forward
            setattr(block, _PREVIOUS_FORWARD_ATTR, vars(block).get("forward"))
        setattr(block, _SPEC_ATTR, moe_spec(block))
        setattr(block, _BACKEND_ATTR, chosen)
        setattr(block, _CHUNK_ATTR, chunk_tokens)
        setattr(block, _FEEDS_RESIDUAL_ATTR, False)
        block.forward = types.MethodType(_sparse_moe_block_forward, block)
    decoder_layers = moe_classes("decoder_layer")
    for layer in model.modules():
        if isinstance(layer, decoder_layers) and hasattr(layer.mlp, _FEEDS_RESIDUAL_ATTR):
            setattr(layer.mlp, _FEEDS_RESIDUAL_ATTR, True)  # its output only enters `residual + mlp(...)`
    logger.info("MoE: %d sparse MoE blocks use backend %s (requested %s)", len(blocks), chosen, backend)
    return chosen


def revert_moe(model: torch.nn.Module) -> int:
    """Undo `apply_moe`: the blocks' previous forwards.

    Returns:
        The number of blocks reverted (0 when nothing was patched).
    """
    reverted = 0
    for module in model.modules():
        if hasattr(module, _BACKEND_ATTR):
            restore_instance_attr(module, "forward", getattr(module, _PREVIOUS_FORWARD_ATTR))
            for name in (_BACKEND_ATTR, _PREVIOUS_FORWARD_ATTR, _FEEDS_RESIDUAL_ATTR, _SPEC_ATTR, _CHUNK_ATTR):
                delattr(module, name)
            reverted += 1
    return reverted


def augment_expert_weights(model: torch.nn.Module) -> int:
    """Lay every frozen expert weight that carries split LoRA out with LoRA slots (in place).

    For the ``grouped_mm`` backend: each such ``gate_up_proj``/``down_proj`` becomes a view inside an
    [E, N + R, C + R] tensor (`lightning_ft.kernels.moe.grouped_mm.augment_expert_weight`), so the
    LoRA term joins the base GEMM along K in the forward and in the input gradient. The backend
    falls back to adding LoRA apart (and logs nothing) wherever the layout no longer holds: another
    rank, a moved or replaced weight, the probe's "copies" mode. Call after the adapters exist
    (``get_peft_model``) and before a strategy shards the parameters (not under FSDP2: it re-lays
    the parameters out itself). `revert_moe` keeps the layout (a view computes as before).

    Returns:
        The number of weights laid out (already laid-out weights of the same rank are skipped).
    """
    count, sparse_blocks = 0, moe_classes("sparse_block")
    for block in (m for m in model.modules() if isinstance(m, sparse_blocks)):
        experts, loras = _experts_and_lora(block.experts)
        if getattr(experts, "is_transposed", False):  # the slots are laid out for [E, N, C] weights (not gpt-oss's)
            continue
        for name, lora in loras.items():
            weight = getattr(experts, name)
            if nf4_weight(experts, name) is not None or mxfp4_weight(experts, name) is not None:
                continue  # the parameter is a placeholder: 4-bit weights have no slots
            rank = padded_rank(lora.lora_A.shape[0] // lora.num_experts, weight.dtype)
            if not weight.requires_grad and augment_expert_weight(weight, rank):
                count += 1
    return count


def convert_experts_to_fp8(model: torch.nn.Module) -> tuple[int, str | None]:
    """``strategy.fp8``: hold every frozen expert weight that carries PEFT's split LoRA in e4m3, in place
    (`lightning_ft.strategies.fp8.convert_expert_weight`; the triton backend reads them). Experts without LoRA stay
    as they are, as the linear layers without LoRA do, and so do NF4 experts (`lightning_ft.model.nf4_experts`: the
    grouped GEMM dequantises them to the model's dtype). Call after `apply_moe`.

    Returns:
        (the number of weights converted (weights already in fp8 are skipped), why a block's were left in their dtype
        where one was: its backend is not ``triton``, ``moe.backend=hf`` included
        (`lightning_ft.strategies.fp8.fp8_experts_blocker`), else None).
    """
    count, left, sparse_blocks = 0, None, moe_classes("sparse_block")
    for block in (m for m in model.modules() if isinstance(m, sparse_blocks)):
        experts, loras = _experts_and_lora(block.experts)
        names = [
            n for n in loras
            if not getattr(experts, n).requires_grad and not hasattr(experts, f"{n}_fp8") and nf4_weight(experts, n) is None
        ]  # fmt: skip
        if names and (blocker := fp8_experts_blocker(getattr(block, _BACKEND_ATTR, "hf"))):
            left = blocker
            continue
        for name in names:
            convert_expert_weight(experts, name, transposed=_experts_layout(experts)["is_transposed"])
            count += 1
    return count, left


def _sparse_moe_block_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Routed (and shared) experts on [..., D] hidden states; the output of the table's sparse block
    (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``Glm4MoeMoE``, ``DeepseekV3MoE``; with
    the router scores [T, K] too for ``GptOssMLP``)."""
    spec = getattr(self, _SPEC_ATTR)
    jitter = getattr(self, "jitter_noise", 0.0)
    if self.training and jitter > 0:  # Mixtral's router_jitter_noise: the same draw as transformers' (out of place)
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
    hidden_dim = hidden_states.shape[-1]
    x_TD = hidden_states.reshape(-1, hidden_dim)
    with _RouterTopK():  # HF's router, its torch.topk on our kernel
        # a module call: HF's router-logit hooks fire
        _, topk_weight_TK, topk_idx_TK = getattr(self, spec.router_attr)(x_TD)
    experts, loras = _experts_and_lora(self.experts)
    w_gate_up_EFD, w_down_EDI, act_fn, biases = _expert_math(experts)
    math = dict(gate_up_lora=loras.get("gate_up_proj"), down_lora=loras.get("down_proj"), biases=biases, backend=getattr(self, _BACKEND_ATTR))
    # the decoder layer returns residual + mlp(...): in a recompute (the graphs' or torch.utils.checkpoint's) nothing reads it
    feeds_residual, in_checkpoint = getattr(self, _FEEDS_RESIDUAL_ATTR), checkpoint_pass()
    checkpointed = recomputing_for_backward() or in_checkpoint is not None
    chunk_tokens = _chunk_tokens(getattr(self, _CHUNK_ATTR), topk_idx_TK.shape[1], w_gate_up_EFD, checkpointed)
    if chunk_tokens is not None and x_TD.shape[0] > chunk_tokens:  # one chunk's working set at a time; nothing kept
        # torch's recompute (of this block's own layer only: its output feeds that layer's output alone) must save what
        # its forward saved: the chunks save their inputs either way
        own_layer = in_checkpoint == "recompute" and getattr(checkpointed_layer(), "mlp", None) is self
        unread = feeds_residual and (recomputing_for_backward() or own_layer)
        out_TD = moe_experts_in_chunks(
            x_TD, topk_weight_TK, topk_idx_TK, experts.num_experts, w_gate_up_EFD, w_down_EDI, act_fn,
            chunk_tokens=chunk_tokens, output_needed=not unread, **math,
        )  # fmt: skip
    else:
        routing = sort_by_expert(topk_idx_TK, experts.num_experts)
        out_TD = moe_experts(
            x_TD, topk_weight_TK, routing, w_gate_up_EFD, w_down_EDI, act_fn, keep=kept.active("mlp"),
            output_needed=not (feeds_residual and recomputing_for_backward()), **math,
        )  # fmt: skip
    out = out_TD.view_as(hidden_states)
    shared_experts = getattr(self, "shared_experts", None)  # DeepSeek-V3 / GLM-4.5: a dense MLP on every token
    if shared_experts is not None:
        out = out + shared_experts(hidden_states)
    return (out, topk_weight_TK) if spec.returns_router_scores else out


def _plain_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    """``(input, k)`` of a ``torch.topk`` call that `topk` computes: a 2-D input along its last dim,
    largest, no ``out``; else None. ``sorted=False`` too (DeepSeek-V3's and GLM-4.5's routers): it
    promises no order, so `topk`'s sorted one serves, with the same selection."""
    if isinstance(input, torch.Tensor) and input.dim() == 2 and dim in (-1, 1) and largest and out is None:
        return input, k
    return None


class _RouterTopK(torch.overrides.TorchFunctionMode):
    """Within: ``torch.topk`` calls that `lightning_ft.kernels.moe.routing.topk` computes run it (the
    same selection; at 8K tokens of Qwen3-30B-A3B ~1.6 ms per 12-layer step less); every other torch
    call as it is. Entered around HF's router call, which stays HF's own code."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            try:
                plain = _plain_topk(*args, **kwargs)
            except TypeError:
                plain = None
            if plain is not None:
                return torch.return_types.topk(topk(*plain))
        return func(*args, **kwargs)


def _experts_and_lora(experts: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, ExpertLoRA]]:
    """Unwrap PEFT's nested ``ParamWrapper`` layers: the experts module and its active split LoRA.

    Returns:
        The innermost experts module and ``{parameter_name: ExpertLoRA}`` for each wrapped 3-D
        parameter with an active, unmerged adapter.

    Raises:
        TypeError: a PEFT tuner other than LoRA ``target_parameters`` wraps the experts.
        NotImplementedError: more than one adapter is active on the experts.
    """
    loras: dict[str, ExpertLoRA] = {}
    module = experts
    while isinstance(module, BaseTunerLayer):
        if not isinstance(module, ParamWrapper):
            raise TypeError(
                f"{type(module).__name__} wraps the experts; the MoE patch supports PEFT LoRA through "
                "target_parameters (ParamWrapper) only: use LoRA on the experts, or do not apply_moe"
            )
        if module.disable_adapters and module.merged:
            module.unmerge()  # as ParamWrapper.forward does
        if not module.disable_adapters and not module.merged:
            active = [name for name in module.active_adapters if name in module.lora_A]
            if len(active) > 1:
                raise NotImplementedError(
                    f"{len(active)} adapters active on the experts; split LoRA runs one: "
                    "set_adapter() one of them, or merge the others"
                )
            if active:
                name = active[0]
                loras[module.parameter_name] = ExpertLoRA(
                    lora_A=module.lora_A[name].weight,
                    lora_B=module.lora_B[name].weight,
                    scaling=module.scaling[name],
                    num_experts=module.num_experts,
                )
        module = module.base_layer
    return module, loras
