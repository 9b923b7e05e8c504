"""What of the hot path an architecture takes: packed rows and the chunked CE, checked on a tiny copy of it.

Any causal LM transformers builds trains; what differs per architecture is whether two of our
shortcuts compute what its own code computes:

    packing   a packed row (documents side by side, ``position_ids`` restarting at 0, attention kept
              inside each document by `lightning_ft.model.attention`) gives every document the
              hidden states it gets alone. Not so where attention does not go through transformers'
              attention-function registry (Bloom's ALiBi), where a layer carries state along the
              row (Mamba, RWKV, hybrid SSM models), where the positions are not read from
              ``position_ids``, or where the model does not pass our keyword down to attention.
    lm head   the logits are ``lm_head(hidden)``, so the chunked linear cross-entropy may compute
              the loss from the hidden states. Not so where the model's forward changes them
              after the head (Gemma 2/3's final logit softcapping, Cohere's logit scale).

`architecture_support` answers both from the real config: it builds a tiny copy of the
architecture (`tiny_config`: the config's structure with small sizes, each distinct layer type
kept, sliding windows and key-compression rates shrunk to 2 tokens so they act on the probe) with random fp32 weights on the
CPU, runs two documents packed and each alone, and compares with transformers' own eager
implementation (atol 1e-5). The same copy tells whether the model is causal: whether changing a
document's last token changes its earlier logits (BERT's family built with ``is_decoder=False``
is not; `lightning_ft.model.build` refuses it). A few hundred milliseconds, once per architecture and process. Where
the tiny copy cannot be built, both answers are no: the model trains as transformers computes it.
Without packing the rows run padded (`lightning_ft.data.packing.PackedBatch.padded_rows`) through
the model's stock attention.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from lightning_ft.model.attention import packed_forward

__all__ = ["ArchitectureSupport", "architecture_support", "decoder_of", "tiny_config"]

# config fields shrunk for the probe, and their values: hidden 32, 2 heads (1 key/value head) of 16
_TINY_SIZES = {
    "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 48,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "vocab_size": 64, "max_position_embeddings": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1, "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "first_k_dense_replace": 1, "query_pre_attn_scalar": 16,
    "global_head_dim": 16, "attention_chunk_size": 4, "d_head": 16,
    "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 16, "decoder_layers": 2, "encoder_layers": 2,
    "decoder_attention_heads": 2, "encoder_attention_heads": 2, "decoder_ffn_dim": 48, "encoder_ffn_dim": 48,
    "embedding_size": 32, "input_embedding_size": 32, "output_embedding_size": 32,
}  # fmt: skip
_PROBE_WINDOW = 2  # sliding windows shorter than the probe's documents (3 and 4 tokens)
_PROBE_DOCS = ((3, 7, 1), (5, 2, 9, 4))
_ATOL = 1e-5


@dataclass(frozen=True)
class ArchitectureSupport:
    """Whether an architecture takes packed rows and the chunked CE, and whether it is causal; each ``None`` where it
    does (is), else why not. ``causal`` is None also where the tiny copy could not tell (it did not build)."""

    packing: str | None
    plain_head: str | None
    causal: str | None = None


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder under ``model``'s LM head (hidden states out): the module at its ``base_model_prefix``, else at
    ``model`` (Llama 4's text-only causal LM keeps the multimodal prefix ``language_model`` and holds ``model``)."""
    decoder = getattr(model, model.base_model_prefix, None)
    return decoder if decoder is not None else model.model


def tiny_config(config: Any) -> Any:
    """``config`` with small sizes (hidden 32, 2 heads of 16, vocab 64, 4 experts of top 2) and one layer per
    distinct entry of its ``layer_types`` and ``mlp_layer_types`` (2 layers without them), every per-layer field
    cut to those layers, sliding windows and key-compression rates (DeepSeek-V4) of 2 tokens.

    Only fields the config has are changed; the rest of its structure (activation, norms, biases,
    RoPE type, tied embeddings, which layers are sparse or slide) is kept.

    Raises:
        Exception: what the config class raises for the shrunk values (e.g. an SSM's head count
            that must divide its width).
    """
    return type(config)(**_tiny_values(config.to_dict(), type(config)))


def _tiny_values(values: dict[str, Any], config_class: type) -> dict[str, Any]:
    """`tiny_config`'s rules on a config's ``to_dict()`` values; nested sub-configs (``config_class.sub_configs``:
    BLT's patcher, encoder, decoder and global transformer) are shrunk by the same rules.

    The layers kept are the first of each distinct (``layer_types``, ``mlp_layer_types``) entry, the first two
    where all are alike; every per-layer field follows them: a list as long as the layer count (Gemma 3n's
    ``activation_sparsity_pattern``, Laguna's heads per layer) keeps the kept layers' entries, a dict keyed by
    layer index (Gemma 4's ``per_layer_config``) their entries renumbered.
    """
    values = dict(values)
    values.pop("transformers_version", None)
    for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if isinstance(values.get(key), dict) and isinstance(sub_class, type):
            values[key] = _tiny_values(values[key], sub_class)
    aliases = getattr(config_class, "attribute_map", {})  # e.g. GPT-2's hidden_size -> n_embd
    old = dict(values)
    _shrink_sizes(values, aliases)
    layers = aliases.get("num_hidden_layers", "num_hidden_layers")
    if isinstance(old.get(layers), int):
        kept = _kept_layers(values, aliases, old[layers])
        for key, value in old.items():
            if key in _NOT_PER_LAYER:
                continue
            if isinstance(value, list) and len(value) == old[layers]:
                values[key] = [values[key][i] for i in kept]
            elif _by_layer(value):
                values[key] = {type(k)(kept.index(int(k))): v for k, v in values[key].items() if int(k) in kept}
        values[layers] = len(kept)
    if values.get("sliding_window"):
        values["sliding_window"] = _PROBE_WINDOW
    if isinstance(values.get("compress_rates"), dict):  # DeepSeek-V4's compressed keys: from 2 tokens on, as windows
        values["compress_rates"] = {kind: min(rate, _PROBE_WINDOW) for kind, rate in values["compress_rates"].items()}
    if values.get("kv_lora_rank") is not None:  # MLA (DeepSeek-V3): keys and values come in every query head, and
        values["num_key_value_heads"] = values["num_attention_heads"]  # the rotary tables span the RoPE part only
        if aliases.get("head_dim") != "qk_rope_head_dim":  # GLM-4.7-Flash's config aliases the two
            values["head_dim"] = values["qk_rope_head_dim"]
        if values.get("qk_head_dim") is not None:  # a stored sum (LongCat-Flash, DeepSeek-V2)
            values["qk_head_dim"] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    if isinstance(old.get(aliases.get("num_experts_per_tok", "num_experts_per_tok")), int):  # top 1 stays top 1 (ZAYA)
        key = aliases.get("num_experts_per_tok", "num_experts_per_tok")
        values[key] = min(old[key], values[key])
    _fill_ssm_width(values)
    if values.get("rotary_dim") is not None:  # partial rotary as a width (GPT-J, CodeGen): half the tiny head
        values["rotary_dim"] = _TINY_SIZES["head_dim"] // 2
    rope = values.get("rope_parameters")
    for params in (rope.values() if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values()) else [rope]):
        if isinstance(params, dict) and params.get("rope_type") == "yarn" and params.get("original_max_position_embeddings") \
                and old.get("max_position_embeddings"):
            # YaRN's pre-extension length, cut with the context so their ratio stays the factor's (else transformers warns)
            params["original_max_position_embeddings"] = max(1, params["original_max_position_embeddings"]
                                                             * values["max_position_embeddings"] // old["max_position_embeddings"])
    values.pop("mlp_only_layers", None)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # inside the tiny vocabulary
        if values.get(key) is not None:
            values[key] = [0] if isinstance(values[key], list) else 0
    return values


# lists and integer-keyed dicts that are never one entry per layer, even where their length equals the layer count
_NOT_PER_LAYER = frozenset({"architectures", "time_step_limit", "id2label", "label2id"})


def _by_layer(value: Any) -> bool:
    """Whether ``value`` is a dict keyed by layer index (``{"05": {...}}``; ``id2label`` is in `_NOT_PER_LAYER`)."""
    return isinstance(value, dict) and bool(value) and all(str(k).isdigit() for k in value)


def _shrink_sizes(values: dict[str, Any], aliases: dict[str, str]) -> None:
    """The `_TINY_SIZES` fields ``values`` holds (also per layer: Gemma 3n's list of intermediate sizes, the head
    dims in Gemma 4's ``per_layer_config``) set to their tiny values, in place."""
    for key, value in _TINY_SIZES.items():
        key = aliases.get(key, key)
        if isinstance(values.get(key), list):
            values[key] = [value] * len(values[key])
        elif values.get(key) is not None:
            values[key] = value
    for key, per_layer in values.items():
        if key not in _NOT_PER_LAYER and _by_layer(per_layer):
            for entry in per_layer.values():
                if isinstance(entry, dict):
                    _shrink_sizes(entry, {})


def _fill_ssm_width(values: dict[str, Any]) -> None:
    """A Mamba-2 mixer's heads (Mamba-2's ``num_heads`` of ``head_dim``, Bamba's ``mamba_n_heads`` of
    ``mamba_d_head``) fill its expanded width ``expand * hidden_size`` (Falcon-H1's ``mamba_d_ssm`` set to it) at
    the tiny head size, in one group; in place."""
    for heads, head_dim, expand, groups in (
        ("num_heads", "head_dim", "expand", "n_groups"), ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_n_groups"),
    ):  # fmt: skip
        if all(isinstance(values.get(key), int) for key in (heads, head_dim, expand, "hidden_size")):
            values[head_dim] = _TINY_SIZES["head_dim"]
            values[heads] = values[expand] * values["hidden_size"] // values[head_dim]
            if values.get("mamba_d_ssm") is not None:
                values["mamba_d_ssm"] = values[expand] * values["hidden_size"]
            if values.get(groups) is not None:
                values[groups] = 1


def _kept_layers(values: dict[str, Any], aliases: dict[str, str], count: int) -> list[int]:
    """Which of the ``count`` layers the tiny copy keeps: the first of each distinct (layer type, MLP type) of
    ``values``' ``layer_types`` (under its alias: Zamba's ``layers_block_type``) and ``mlp_layer_types``, else the
    first two."""
    kinds = [values.get(aliases.get("layer_types", "layer_types")), values.get("mlp_layer_types")]
    kinds = [kind for kind in kinds if isinstance(kind, list) and len(kind) == count]
    first: dict[tuple, int] = {}
    for i in range(count):
        first.setdefault(tuple(kind[i] for kind in kinds), i)
    kept = sorted(first.values())
    return kept if len(kept) > 1 else list(range(min(count, 2)))


def architecture_support(config: Any) -> ArchitectureSupport:
    """Whether packed rows and the chunked CE compute what transformers computes, for ``config``'s architecture.

    Cached per config structure (sizes aside). See the module docstring for what is compared.
    """
    try:
        tiny = tiny_config(config).to_dict()
    except Exception as err:  # the config class's validation of the shrunk values
        why = f"no tiny copy of {config.model_type} to check it on ({type(err).__name__}: {err})"
        return ArchitectureSupport(why, why)
    return _support(json.dumps(tiny, sort_keys=True, default=str), type(config))


@lru_cache(maxsize=None)
def _support(tiny_json: str, config_class: type) -> ArchitectureSupport:
    tiny = json.loads(tiny_json)
    tiny.pop("model_type", None)
    return _probe(config_class(**tiny))


def _probe(config: Any) -> ArchitectureSupport:
    from transformers import AutoModelForCausalLM

    from lightning_ft.data.packing import collate_packed
    from lightning_ft.model.attention import register_packed_attention

    # the CPU's generator alone, seeded and restored: `torch.manual_seed` would also reseed every GPU's, which
    # the fork does not restore (the run's seed would stop governing its draws there, e.g. LoRA's init and dropout)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.device("cpu"):
        torch.random.default_generator.manual_seed(0)
        try:
            stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
        except Exception as err:
            why = f"the tiny copy of {config.model_type} does not build ({type(err).__name__}: {err})"
            return ArchitectureSupport(why, why)
        backbone = decoder_of(stock)
        docs = [torch.tensor([ids]) for ids in _PROBE_DOCS]
        alone = [backbone(input_ids=ids, use_cache=False).last_hidden_state for ids in docs]
        logits = [stock(input_ids=ids, use_cache=False).logits for ids in docs]
        head = stock.get_output_embeddings()
        plain = all(torch.allclose(head(h), out, atol=_ATOL, rtol=0) for h, out in zip(alone, logits))
        plain_head = None if plain else "the model changes its logits after the LM head (e.g. logit softcapping or scaling)"
        packing = _packing_differs(stock, alone, collate_packed([(d[0].tolist(),) * 2 for d in docs]), register_packed_attention())
        causal = _later_token_seen(stock, docs[1], logits[1])
    return ArchitectureSupport(packing, plain_head, causal)


def _later_token_seen(stock: torch.nn.Module, ids: torch.Tensor, logits: torch.Tensor) -> str | None:
    """Why ``stock`` is not causal (changing the last of ``ids`` changes the earlier ``logits``), or None."""
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % stock.config.vocab_size
    before, after = logits[0, :-1], stock(input_ids=changed, use_cache=False).logits[0, :-1]
    # float noise is ~1e-7 of the logits (fp32); a later token's reach through tiny random weights ~1e-3
    if (before - after).abs().max() > 1e-5 * before.abs().max():
        return "each token sees the later ones (changing the last token changes the earlier logits)"
    return None


def _packing_differs(stock: torch.nn.Module, alone: list[torch.Tensor], batch: Any, attention: str) -> str | None:
    """Why ``batch`` (the documents of ``alone``, packed) does not reproduce ``alone`` through our attention, or None."""
    packed = copy.deepcopy(stock)
    if not packed._supports_attention_backend:
        return "its attention does not go through transformers' attention-function registry"
    packed.set_attn_implementation(attention)
    try:
        with packed_forward():
            hidden = decoder_of(packed)(
                input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch, use_cache=False
            ).last_hidden_state
    except Exception as err:
        return f"its forward fails on a packed row ({type(err).__name__}: {err})"
    if torch.allclose(hidden, torch.cat(alone, dim=1), atol=_ATOL, rtol=0):
        return None
    return "documents of a packed row see each other (state or positions carried along the row)"


def fast_path_lines(model_type: str, support: ArchitectureSupport, kernels: dict[str, bool], applied: list[str]) -> list[str]:
    """The start log: for ``model_type``, packing and each kernel switch, fused or stock (and why) or off.

    Args:
        support: `architecture_support` of the model.
        kernels: the ``kernels`` config group.
        applied: `lightning_ft.model.patching.apply_kernels`' lines ("<switch>: ..."; those of no switch, such as
            "fp8: ...", are logged last).
    """
    from lightning_ft.model.patching import KERNEL_KEYS

    rows = "packed rows" if support.packing is None else f"stock, one document per padded row ({support.packing})"
    lines = [f"{model_type} packing: {rows}"]
    by_switch = {line.split(":", 1)[0]: line for line in applied}
    for name in KERNEL_KEYS:
        if not kernels.get(name, False):
            lines.append(f"{model_type} kernel {name}: off (kernels.{name}=false)")
        elif name in by_switch:
            lines.append(f"{model_type} kernel {by_switch[name]}")
        elif support.plain_head is None:  # fused_linear_cross_entropy, read by the LightningModule
            lines.append(f"{model_type} kernel {name}: chunked over the vocabulary (no [T, vocab] logits)")
        else:
            lines.append(f"{model_type} kernel {name}: stock ({support.plain_head})")
    return lines + [f"{model_type} {line}" for switch, line in by_switch.items() if switch not in KERNEL_KEYS]
