"""Every decoder-only causal LM of the installed transformers trains through our module.

For each ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny copy of its
default config (`lightning_ft.model.support.tiny_config`), LoRA on ``all-linear``, every kernel
switch on, one packed batch of three documents through `FinetuneModule.training_step`; its loss
equals transformers' own (stock attention, each document alone, LoRA unfused) and the LoRA
weights get finite gradients. Packed rows, or padded ones where the architecture cannot take them, are
what `lightning_ft.model.support` decided; either way the loss must be transformers'.

The default run walks `REPRESENTATIVE` (one per kind: patch tables, other attention-registry
models, padded-row and logit-softcapping architectures); ``LIGHTNING_FT_ALL_MODEL_TYPES=1``
walks every type (about 200, a few minutes on one core). `SKIPPED` says why a type is left out.
"""

import os
from pathlib import Path
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lightning_ft.data.packing import collate_packed
from lightning_ft.model.build import ModelBuilder
from lightning_ft.model.patching import KERNEL_KEYS
from lightning_ft.model.support import tiny_config
from lightning_ft.module import FinetuneModule

SKIPPED: dict[str, str] = {}  # model_type -> why the walk leaves it out

REPRESENTATIVE = [
    "llama", "qwen2", "mistral", "phi3", "gemma3_text", "gpt_oss",  # patch tables (gpt-oss: sinks, windows, MoE)
    "gpt2", "olmo2", "starcoder2", "granite",  # attention registry, no table (granite: logits scaled)
    "cohere", "gemma2",  # logits changed after the head; gemma2's attention softcap: padded rows
    "bloom",  # no attention registry (ALiBi): padded rows
]  # fmt: skip
ALL = os.environ.get("LIGHTNING_FT_ALL_MODEL_TYPES") == "1"
TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if ALL else REPRESENTATIVE
DOCS = [[5, 9, 3, 7, 1], [2, 8], [4, 6, 11, 3]]


def _model_cfg(model_type):
    values = tiny_config(AutoConfig.for_model(model_type)).to_dict()
    return {"init": "random", "config": {**values, "model_type": model_type}}


def _lora_targets(model_type):
    """``all-linear``, but where PEFT refuses LoRA on some of an SSM's linears (Mamba's out_proj) the rest of them."""
    if model_type not in ("mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h"):
        return "all-linear"
    model = AutoModelForCausalLM.from_config(tiny_config(AutoConfig.for_model(model_type)))
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names - {"out_proj", "lm_head"})


def _stock_loss_sum(model):
    """Σ token CE of each document alone, through transformers' own forward (kernels reverted by the caller)."""
    total = 0.0
    for ids in DOCS:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
        total = total + torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
    return total


@pytest.mark.parametrize("model_type", [t for t in TYPES if t not in SKIPPED])
def test_one_training_step_matches_transformers(model_type, monkeypatch):
    from lightning_ft.model.patching import revert_kernels

    torch.manual_seed(0)
    kernels = dict.fromkeys(KERNEL_KEYS, True)
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": _lora_targets(model_type)}
    module = FinetuneModule(ModelBuilder(model=_model_cfg(model_type), lora=lora, kernels=kernels))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module.configure_model()
    module.model.eval()  # no dropout (GPT-2's config has some): the comparison is of the math
    for name, p in module.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    batch = collate_packed([(ids, ids) for ids in DOCS])
    monkeypatch.setattr(FinetuneModule, "trainer", type("T", (), {"accumulate_grad_batches": 1, "world_size": 1}), raising=False)
    loss = module.training_step(batch, 0)
    loss.backward()
    grads = {n: p.grad for n, p in module.model.named_parameters() if p.requires_grad}
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n)

    revert_kernels(module.model)
    hf = module.hf_model
    if module.packed:
        hf.set_attn_implementation("eager")
    with torch.no_grad():
        expected = _stock_loss_sum(module.model) / batch.step_target_tokens
    torch.testing.assert_close(loss.detach(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", [
    "qwen2_tiny", "mistral_tiny", "phi3_tiny", "gemma3_tiny", "mixtral_tiny", "glm4_moe_tiny", "deepseek_v3_tiny",
    "glm4_moe_lite_tiny", "gpt_oss_tiny",
])  # fmt: skip
def test_each_tiny_family_config_builds_on_packed_rows(name):
    import yaml

    from lightning_ft.config import config_dir

    model = yaml.safe_load((Path(config_dir()) / "model" / f"{name}.yaml").read_text())
    lora = {"rank": 2, "alpha": 4, "dropout": 0.0, "target_modules": "all-linear"}
    built = ModelBuilder(model=model, lora=lora, vocab_size=64)(torch.device("cpu"))
    assert built.packed and built.plain_head


@pytest.mark.parametrize("name", ["deepseek_v3_tiny", "glm4_moe_lite_tiny"])
def test_the_mla_lora_config_targets_mla_projections_and_experts(name):
    import yaml

    from lightning_ft.config import config_dir

    model = yaml.safe_load((Path(config_dir()) / "model" / f"{name}.yaml").read_text())
    lora = yaml.safe_load((Path(config_dir()) / "lora" / "mla.yaml").read_text())
    built = ModelBuilder(model=model, lora=lora, vocab_size=64)(torch.device("cpu"))
    adapted = {path.split(".lora_A")[0].rsplit(".", 1)[-1] for path, _ in built.model.named_parameters() if "lora_A" in path}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= adapted
    assert any("experts" in path and "lora_A" in path for path, _ in built.model.named_parameters())
