"""MoE router training and the load-balancing loss on the tiny Qwen3-MoE, with every MoE backend.

Reference: stock transformers + PEFT (``PeftModel.from_pretrained`` of the adapter we saved) on the
same documents unpacked into padded rows with an ``attention_mask``.
"""

import os
from pathlib import Path
import warnings

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers.models.qwen3_moe import modeling_qwen3_moe

from lightning_ft.data.packing import collate_packed
from lightning_ft.kernels.moe import BACKENDS
from lightning_ft.model.attention import register_packed_attention
from lightning_ft.model.build import ModelBuilder, load_causal_lm
from lightning_ft.module import FinetuneModule

from tiny_model import LORA, TINY_MODEL

AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
_TRITON = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the triton backend runs on the CPU only under TRITON_INTERPRET=1"
)
MOE_BACKENDS = ["hf", *(pytest.param(b, marks=_TRITON) if b == "triton" else b for b in BACKENDS)]


def _config(**overrides):
    return {**TINY_MODEL, "config": {**TINY_MODEL["config"], **overrides}}


def _module(config=None, lora=LORA, **moe):
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model=_config(**(config or {})), lora=lora, moe=moe))
    module.configure_model()
    for name, p in module.model.named_parameters():  # non-zero lora_B: LoRA changes the output
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return module


def _docs(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(ids, ids) for ids in (torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths)]


def _stock(adapter_dir, config, attention="sdpa"):
    """Stock transformers (eager experts) + PEFT, loaded from our adapter file, the same random base."""
    torch.manual_seed(0)
    base = load_causal_lm(None, "random", dict(_config(**config)["config"]), attn_implementation=register_packed_attention(attention))
    base.set_experts_implementation("eager")
    return PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)


def _router_grads(model):
    return {n.split("model.layers.")[-1]: p.grad for n, p in model.named_parameters() if ".mlp.gate." in n and p.requires_grad}


@pytest.mark.parametrize("backend", MOE_BACKENDS)
def test_aux_loss_and_router_gradients_equal_stock_transformers(backend, tmp_path):
    """The load-balancing loss of a packed row is transformers' function of the same router logits (without a
    mask, as with a mask of ones); on the documents unpacked into padded rows, transformers' own ``aux_loss``
    (which masks the padding) and its total ``loss`` equal ours, and so do the trained routers' gradients."""
    module = _module(AUX, backend=backend, train_router=True)
    lengths = [11, 6, 9]
    batch = collate_packed(_docs(lengths))
    loss_sum, aux_loss = module.loss_terms(batch)
    total = loss_sum / batch.num_target_tokens + 0.5 * aux_loss
    total.backward()
    ours = _router_grads(module.model)
    assert len(ours) == 2 and all(g.abs().max() > 1e-4 for g in ours.values())

    hf = module.hf_model
    with torch.no_grad():
        logits = hf.model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch,
                          output_router_logits=True).router_logits
    func = modeling_qwen3_moe.load_balancing_loss_func
    assert torch.equal(aux_loss, func(logits, 4, 2))
    torch.testing.assert_close(aux_loss, func(logits, 4, 2, torch.ones_like(batch.input_ids)), rtol=1e-6, atol=0)

    module.model.save_pretrained(tmp_path)
    stock = _stock(tmp_path, AUX)
    rows = len(lengths), max(lengths)
    input_ids, labels = torch.zeros(rows, dtype=torch.long), torch.full(rows, -100)
    mask = torch.zeros(rows, dtype=torch.long)
    for row, (ids, _) in enumerate(_docs(lengths)):
        input_ids[row, : len(ids)] = labels[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
    out = stock(input_ids=input_ids, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()
    torch.testing.assert_close(aux_loss, out.aux_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total, out.loss, rtol=1e-5, atol=1e-5)
    theirs = _router_grads(stock)
    assert theirs.keys() == ours.keys()
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_training_step_adds_the_scaled_aux_loss(monkeypatch):
    """The coefficient counts: 0 and 10 give losses 10 · aux_loss apart."""
    monkeypatch.setattr(FinetuneModule, "trainer", type("T", (), {"accumulate_grad_batches": 2, "world_size": 1})(), raising=False)
    module = _module(AUX, backend="native_torch")
    batch = collate_packed(_docs([11, 6]))
    with torch.no_grad():
        loss_sum, aux_loss = module.loss_terms(batch)
        returned = {}
        for coef in (0.0, 10.0):
            module.aux_loss_coef = coef
            returned[coef] = module.training_step(batch, 0)
    assert aux_loss > 0.5 and module._step_micro_batches == 2
    torch.testing.assert_close(returned[0.0], loss_sum * 2 / batch.num_target_tokens)
    torch.testing.assert_close(returned[10.0] - returned[0.0], 10 * aux_loss)
    assert module.loss_terms(batch, aux=False)[1] is None


@pytest.fixture
def one_thread():
    """One CPU thread: the trained model (fused LoRA) and the reloaded stock PEFT model split their reductions the
    same way only then, so their logits can be compared bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_router_trains_and_reloads_exactly_with_embeddings_and_head(tmp_path, monkeypatch, one_thread):
    """moe.train_router and lora.modules_to_save (embeddings and LM head; the fused loss reads the head's trainable
    copy): two steps move them; the adapter file holds them in PEFT's format, PeftModel.from_pretrained gives the same
    weights and logits; the Lightning checkpoint's state dict (trainable weights only) holds them for a resume."""
    lora = {**LORA, "modules_to_save": ["embed_tokens", "lm_head"]}
    torch.manual_seed(0)
    builder = ModelBuilder(model=_config(**AUX), lora=lora, moe={"backend": "hf", "train_router": True},
                           kernels={"fused_linear_cross_entropy": True})
    module = FinetuneModule(builder)
    module.configure_model()
    monkeypatch.setattr(FinetuneModule, "trainer", type("T", (), {"world_size": 1})(), raising=False)
    trainable = {n: p for n, p in module.model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert sorted(n.split(".modules_to_save")[0].split("model.")[-1] for n in trainable) == [
        "embed_tokens", "layers.0.mlp.gate", "layers.1.mlp.gate", "lm_head"
    ]
    before = {n: p.detach().clone() for n, p in trainable.items()}
    optimizer = torch.optim.AdamW([p for p in module.model.parameters() if p.requires_grad], lr=1e-2)
    batch = collate_packed(_docs([11, 6, 9]))
    for _ in range(2):
        loss_sum, aux_loss = module.loss_terms(batch)
        (loss_sum / batch.num_target_tokens + 0.5 * aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(not torch.equal(p, before[n]) for n, p in trainable.items())

    module.model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert {k for k in saved if "lora" not in k} == {
        "base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight",
        "base_model.model.model.layers.0.mlp.gate.weight", "base_model.model.model.layers.1.mlp.gate.weight",
    }
    reloaded = _stock(tmp_path, AUX).eval()
    module.model.eval()
    reloaded_params = dict(reloaded.named_parameters())
    for name, p in trainable.items():
        assert torch.equal(reloaded_params[name], p), name
    with torch.no_grad():
        kwargs = dict(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch)
        assert torch.equal(reloaded(**kwargs).logits, module.model(**kwargs).logits)

    # what on_save_checkpoint keeps (the trainable weights) restores the trained modules into a fresh build
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert sum(".modules_to_save." in k for k in checkpoint["state_dict"]) == 4
    torch.manual_seed(0)
    resumed = FinetuneModule(builder)
    resumed.configure_model()
    resumed.load_state_dict(checkpoint["state_dict"], strict=resumed.strict_loading)  # as Lightning's resume does
    resumed_params = dict(resumed.model.named_parameters())
    for name, p in trainable.items():
        assert torch.equal(resumed_params[name], p), name


@pytest.mark.parametrize("backend", ["hf", "native_torch"])
def test_full_fine_tuning_trains_the_router_only_on_request(backend):
    for train_router in (False, True):
        module = _module(lora={"enabled": False}, backend=backend, train_router=train_router)
        routers = [p for n, p in module.model.named_parameters() if n.endswith("mlp.gate.weight")]
        assert len(routers) == 2 and all(p.requires_grad is train_router for p in routers)
        assert all(p.requires_grad for n, p in module.model.named_parameters() if "mlp.gate" not in n)


def test_top1_normalised_routing_warns_that_the_lm_loss_cannot_train_the_router():
    """The warning's claim holds: the router's gradient from the LM loss is zero up to rounding; the aux loss moves it."""
    top1 = {"num_experts_per_tok": 1}
    with pytest.warns(UserWarning, match=r"top-1 routing .* nothing trains it.*output_router_logits=true"):
        _module(top1, backend="native_torch", train_router=True)
    with pytest.warns(UserWarning, match=r"only the load-balancing loss \(router_aux_loss_coef=0.5\) trains it"):
        module = _module({**top1, **AUX}, backend="native_torch", train_router=True)
    batch = collate_packed(_docs([11, 6, 9]))
    loss_sum, aux_loss = module.loss_terms(batch)
    loss_sum.backward(retain_graph=True)
    assert max(g.abs().max() for g in _router_grads(module.model).values()) < 1e-8
    module.model.zero_grad()
    aux_loss.backward()
    assert min(g.abs().max() for g in _router_grads(module.model).values()) > 1e-4
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # top-2, or a frozen router: nothing to say
        _module(AUX, backend="native_torch", train_router=True)
        _module(top1, backend="native_torch")


def test_router_training_refusals_name_the_keys(tmp_path):
    dense = {"init": "random", "config": dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)}
    with pytest.raises(ValueError, match=r"moe.train_router=true: Qwen3ForCausalLM has no MoE router .*moe.train_router=false"):
        FinetuneModule(ModelBuilder(model=dense, lora=LORA, moe={"train_router": True})).configure_model()
    with pytest.raises(ValueError, match=r"routers \(mlp.gate\) would train although moe.train_router=false: lora.modules_to_save"):
        _module(lora={**LORA, "modules_to_save": ["mlp.gate"]})
    with pytest.raises(ValueError, match=r"lora.modules_to_save: \['lm_haed'\] are not in the model"):
        _module(lora={**LORA, "modules_to_save": ["lm_haed"]})
    with pytest.raises(ValueError, match=r"lora.modules_to_save='lm_head': expected a list"):
        _module(lora={**LORA, "modules_to_save": "lm_head"})
    with pytest.raises(ValueError, match=r"lora.modules_to_save=\['lm_head'\] needs lora.enabled=true"):
        _module(lora={"enabled": False, "modules_to_save": ["lm_head"]})
    _module().model.save_pretrained(tmp_path)  # an adapter without the router
    with pytest.raises(ValueError, match=r"moe.train_router=true, but the MoE routers stay frozen: the lora.init_from adapter"):
        _module(lora={**LORA, "init_from": str(tmp_path)}, train_router=True)


@pytest.mark.parametrize("name", ["mixtral_tiny", "glm4_moe_tiny", "deepseek_v3_tiny", "glm4_moe_lite_tiny"])
def test_aux_loss_of_each_moe_family(name):
    """Mixtral: the load-balancing loss is transformers' function of its router logits, with our MoE path.
    GLM-4.5 and DeepSeek-V3 have none in transformers (their bias balances the experts): refused at build."""
    import yaml

    from lightning_ft.config import config_dir

    model = yaml.safe_load((Path(config_dir()) / "model" / f"{name}.yaml").read_text())
    model["config"] |= AUX
    lora = {**LORA, "target_modules": ["o_proj"]}  # in every family (MLA has no q_proj / v_proj with q_lora_rank)
    builder = ModelBuilder(model=model, lora=lora, moe={"backend": "native_torch"}, vocab_size=64)
    if name != "mixtral_tiny":
        with pytest.raises(ValueError, match=r"output_router_logits=true: .*ForCausalLM's module .* no load_balancing_loss_func "
                                             r"\(its routers balance the experts with e_score_correction_bias.*output_router_logits=false"):
            FinetuneModule(builder).configure_model()
        return
    torch.manual_seed(0)
    module = FinetuneModule(builder)
    module.configure_model()
    batch = collate_packed(_docs([11, 6, 9]))
    _, aux_loss = module.loss_terms(batch)
    with torch.no_grad():
        logits = module.hf_model.model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch,
                                       output_router_logits=True).router_logits
    from transformers.models.mixtral import modeling_mixtral

    assert len(logits) == 2 and aux_loss > 0.5
    torch.testing.assert_close(aux_loss, modeling_mixtral.load_balancing_loss_func(logits, 4, 2), rtol=1e-6, atol=0)
