"""FSDP2 (``strategy=fsdp2``): sharded training gives one process's gradients, trains, exports and resumes.

The CLI tests start two gloo processes on the CPU, as the DDP test does (PyTorch's FSDP2 runs on
a CPU mesh); the in-process tests shard over a one-process group. The GPU test repeats the
two-process comparison on two GPUs in bf16 with every kernel on.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cli_helpers import FAST, assert_first_step_grads_close, run_cli, summary

from lightning_ft.data.packing import collate_packed
from lightning_ft.data.tokenization import load_tokenizer
from lightning_ft.model.build import ModelBuilder, load_causal_lm
from lightning_ft.module import FinetuneModule
from lightning_ft.strategies.fsdp2 import decoder_layers, gather_state_dict, mixed_precision_policy, shard_model

from tiny_model import LORA, TINY_MODEL as _TINY

TINY_MODEL = {**_TINY, "config": {**_TINY["config"], "tie_word_embeddings": False}}


def _docs(lengths, seed, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [(ids, ids) for ids in (torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths)]


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one rank and its mesh, as Lightning's ModelParallelStrategy makes them."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    finally:
        dist.destroy_process_group()


def _module(tie_word_embeddings=False, lora=LORA, **kwargs):
    torch.manual_seed(0)
    model = {**TINY_MODEL, "config": {**TINY_MODEL["config"], "tie_word_embeddings": tie_word_embeddings}}
    builder_keys = ("kernels", "moe", "vocab_size")
    builder = ModelBuilder(model=model, lora=lora, **{k: kwargs.pop(k) for k in builder_keys if k in kwargs})
    module = FinetuneModule(builder, **kwargs)
    module.configure_model()
    for i, (name, p) in enumerate(module.model.named_parameters()):  # lora_B non-zero: every LoRA weight gets gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(i))
    return module


@pytest.mark.parametrize(
    ("fused", "tied", "lora"),
    [(False, False, LORA), (True, False, LORA), (True, True, LORA), (True, False, {"enabled": False})],
    ids=["lm_head", "fused_loss", "fused_loss_tied_embeddings", "fused_loss_full_fine_tuning"],
)
def test_sharded_loss_and_gradients_equal_the_unsharded_ones(one_process_group, fused, tied, lora):
    """Every weight is a DTensor after sharding; ``loss_sum`` (the root unit's forward) reads the gathered head,
    and a trainable head's gradient (full fine-tuning) reaches its shard."""
    from torch.distributed.tensor import DTensor

    batch = collate_packed(_docs([9, 1, 14], 5))
    results = []
    for shard in (False, True):
        module = _module(kernels={"fused_linear_cross_entropy": fused, "lora": fused}, tie_word_embeddings=tied, lora=lora)
        assert (module.hf_model.get_output_embeddings().weight is module.hf_model.get_input_embeddings().weight) == tied
        if shard:
            shard_model(module, module.model, one_process_group, "32-true")
            assert all(isinstance(p, DTensor) for p in module.parameters())
        loss = module.loss_sum(batch)
        loss.backward()
        grads = {n: p.grad.full_tensor() if shard else p.grad for n, p in module.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
        if shard:  # the export gathers whole tensors: the adapter's (trainable) weights only
            exported = gather_state_dict(module.model, trainable_only=True)
            assert exported.keys() == {n.removeprefix("model.") for n in grads}
            assert not any(isinstance(t, DTensor) for t in exported.values())
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_unsharded_weights_are_freed_as_each_layer_is_sharded(one_process_group, monkeypatch):
    """Nothing holds a whole weight once its unit is sharded: the peak while sharding is one model plus one unit's
    shards, not two models (a 31B MoE built whole on each GPU, then sharded, would otherwise need 1.5x its size)."""
    import gc
    import weakref

    import torch.distributed.fsdp as fsdp

    module = _module(moe={"backend": "native_torch"})
    whole = {id(p): (name, weakref.ref(p)) for name, p in module.named_parameters()}
    sharded_units, still_alive = [], []
    real_fully_shard = fsdp.fully_shard

    def fully_shard(unit, **kwargs):
        params = [id(p) for p in unit.parameters() if id(p) in whole]
        sharded_units.append(type(unit).__name__)
        real_fully_shard(unit, **kwargs)
        gc.collect()
        still_alive.extend(whole[i][0] for i in params if whole[i][1]() is not None)

    monkeypatch.setattr(fsdp, "fully_shard", fully_shard)
    shard_model(module, module.model, one_process_group, "32-true")
    assert sharded_units == ["Qwen3MoeDecoderLayer"] * 2 + ["FinetuneModule"]
    assert not still_alive, still_alive


def test_a_unit_whose_trainable_weights_mix_dtypes_is_refused_before_sharding(one_process_group):
    module = FinetuneModule(ModelBuilder(model={**TINY_MODEL, "dtype": "bfloat16"}, lora=LORA, moe={"backend": "native_torch", "train_router": True}))
    module.configure_model()  # bf16 router trained beside PEFT's fp32 LoRA weights in the same decoder layer
    with pytest.raises(ValueError, match=r"decoder layer 0 have more than one dtype .*moe.train_router=false"):
        shard_model(module, module.model, one_process_group, "bf16-mixed")


def test_decoder_layers_and_the_mixed_precision_policy():
    module = _module()
    layers = decoder_layers(module.model)
    assert [type(m).__name__ for m in layers] == ["Qwen3MoeDecoderLayer"] * 2
    with pytest.raises(ValueError, match="cannot find the decoder layers of Linear.*use strategy=ddp"):
        decoder_layers(torch.nn.Linear(2, 2))
    bf16 = mixed_precision_policy("bf16-mixed")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.cast_forward_inputs) == (torch.bfloat16, torch.float32, False)
    fp32 = mixed_precision_policy("32-true")
    assert (fp32.param_dtype, fp32.reduce_dtype, fp32.cast_forward_inputs) == (None, None, False)


@pytest.mark.slow
def test_generation_eval_with_fsdp2_is_refused_before_any_process_starts(tmp_path):
    proc = run_cli(tmp_path, *FAST, "strategy=fsdp2", "trainer.devices=2", "eval.generate=true", "data.val_fraction=0.2", ok=False)
    assert "error: eval.generate=true does not work with strategy=fsdp2" in proc.stderr and "Traceback" not in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr


def test_fsdp1_is_refused_naming_fsdp2():
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_ft.fit import _check_strategy

    with pytest.raises(ValueError, match="FSDP1 is not supported.*use strategy=fsdp2"):  # Lightning refuses it on a CPU itself
        _check_strategy(FSDPStrategy(), generate=False)


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_gives_the_gradients_of_one_process(tmp_path):
    """2 ranks × 1 micro-batch vs 1 rank × 2 micro-batches, with the fused loss, our MoE experts backend, LoRA on
    attention and experts, and gradient checkpointing: the same rows, the same gradients (gathered from the shards)."""
    common = (*FAST, "trainer.max_steps=1", "+callbacks.dump._target_=cli_helpers.DumpGradients",
              "kernels.fused_linear_cross_entropy=true", "moe=native_torch", "lora=moe", "model.gradient_checkpointing=true")
    fsdp2 = run_cli(tmp_path / "fsdp2", *common, "strategy=fsdp2", "trainer.devices=2", f"+callbacks.dump.path={tmp_path / 'g2'}")
    run_cli(tmp_path / "one", *common, "trainer.accumulate_grad_batches=2", f"+callbacks.dump.path={tmp_path / 'g1'}")

    rank0, rank1 = (torch.load(tmp_path / "g2" / f"rank{r}.pt") for r in (0, 1))
    assert_first_step_grads_close(rank0, torch.load(tmp_path / "g1" / "rank0.pt"))
    assert any("experts" in n for n in rank0) and all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    assert (fsdp2.stdout + fsdp2.stderr).count("summary: ") == 1  # rank 0 alone writes the summary and the adapter
    assert summary(tmp_path / "fsdp2")["world_size"] == 2
    assert (tmp_path / "fsdp2" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_fsdp2_trains_exports_a_peft_adapter_and_resumes_a_killed_run_exactly(tmp_path):
    """8 steps on 2 ranks: the loss falls; the adapter gathered from the shards loads with PEFT and gives the
    trained model's logits; checkpoints are single files in the layout of one device and DDP, so a DDP run killed
    after step 5 resumes under FSDP2 and gives the uninterrupted run's losses (LoRA dropout: RNG states matter)."""
    from peft import PeftModel

    common = (*FAST, "strategy=fsdp2", "trainer.devices=2", "trainer.max_steps=8", "lora.dropout=0.1",
              "callbacks.checkpoint.every_n_train_steps=1", "callbacks.checkpoint.save_top_k=1", "data.val_fraction=0.2")
    full = tmp_path / "full"
    run_cli(full, *common, "+callbacks.dump._target_=cli_helpers.DumpTrainedModel", f"+callbacks.dump.path={full / 'trained.pt'}")
    result = summary(full)
    losses = result["step_losses"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses
    assert result["val_loss"] is not None and result["data"]["val_rows"] == 3  # 3 rows: rank 1 ran a masked copy too

    # the trained model, unsharded in this process: its weights gathered at the end of training
    dumped = torch.load(full / "trained.pt")
    config = result["config"]
    module = FinetuneModule(ModelBuilder(model=config["model"], lora=config["lora"], vocab_size=len(load_tokenizer("builtin"))))
    module.configure_model()
    module.model.load_state_dict(dumped["weights"])
    batch = collate_packed(dumped["docs"])
    base = load_causal_lm(None, "random", dict(config["model"]["config"]), vocab_size=module.builder.vocab_size, attn_implementation="sdpa")
    base.load_state_dict({
        k.removeprefix("base_model.model.").replace(".base_layer.", "."): v for k, v in dumped["weights"].items() if "lora_" not in k
    })
    peft_model = PeftModel.from_pretrained(base, full / "adapter").eval()
    module.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(module.loss_sum(batch), dumped["loss_sum"], rtol=1e-5, atol=1e-5)  # = the sharded model's
        ours = module.model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch).logits
        offsets = batch.cu_seqlens.tolist()  # stock transformers + PEFT on each document alone
        theirs = torch.cat([peft_model(input_ids=batch.input_ids[:, a:b]).logits for a, b in zip(offsets[:-1], offsets[1:])], dim=1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    # the checkpoint: one file, whole tensors, the optimizer state numbered as Optimizer.state_dict() numbers it,
    # as one device and DDP write it
    checkpoint = torch.load(full / "checkpoints" / "last.ckpt", weights_only=False)
    weights, (optimizer,) = list(checkpoint["state_dict"].values()), checkpoint["optimizer_states"]
    assert [i for group in optimizer["param_groups"] for i in group["params"]] == list(range(len(weights))) == sorted(optimizer["state"])
    assert all(optimizer["state"][i]["exp_avg"].shape == w.shape for i, w in enumerate(weights))

    # so a DDP run killed after step 5 resumes under FSDP2 (sharding its checkpoint) as if never interrupted
    killed = tmp_path / "killed"
    ddp = [o if o != "strategy=fsdp2" else "strategy=ddp" for o in common]
    run_cli(killed, *ddp, "+callbacks.crash._target_=cli_helpers.CrashAtStep", "+callbacks.crash.step=5", ok=False)
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["last.ckpt", "step000005.ckpt"]
    run_cli(killed, *common, "ckpt_path=last")
    resumed = summary(killed)["step_losses"]  # fp32; DDP's all-reduce and FSDP2's reduce-scatter round differently
    assert all(abs(a - b) <= 1e-5 for a, b in zip(resumed[5:], losses[5:], strict=True)), (resumed, losses)


@pytest.mark.slow
def test_a_sweep_of_two_rank_jobs_runs_them_one_after_another_in_one_sweep_folder(tmp_path):
    """The second rank, started by Lightning, runs the same sweep in step (one process group for the whole sweep,
    one MASTER_PORT); it is handed the sweep folder, so nothing lands in a second ``multirun/<time>`` folder."""
    proc = run_cli(tmp_path, "-m", "lora.rank=4,8", "trainer.max_steps=2", *FAST, "strategy=fsdp2", "trainer.devices=2")
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job, rank in (("0", 4), ("1", 8)):
        result = summary(sweep / job)
        assert result["status"] == "completed" and result["world_size"] == 2 and result["config"]["lora"]["rank"] == rank
        assert (sweep / job / "train_ddp_process_1.log").exists()  # the second rank's log, in the same job folder
    assert len((sweep / "sweep_summary.md").read_text().splitlines()) == 4  # header, rule, two jobs
    assert (proc.stdout + proc.stderr).count("Initializing distributed") == 2  # once per rank, for both jobs


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (FSDP2 over NCCL)")
def test_fsdp2_on_two_gpus_gives_the_gradients_of_one_gpu_in_bf16_with_every_kernel(tmp_path):
    """The CPU test's comparison on 2 GPUs: bf16 weights, bf16 all-gathers, fp32 gradient reduce-scatter, every
    Triton kernel, the auto MoE backend, varlen attention. Each rank computes what the one GPU computes for its
    micro-batch, but LoRA weights enter the math as bf16 all-gathered copies rather than autocast casts, and fp32
    kernels may read the fp32 weights on one GPU: bf16 rounding, hence a cosine tolerance."""
    common = (*FAST, "trainer=gpu", "precision=bf16", "kernels=all", "moe=auto", "lora=moe", "model.gradient_checkpointing=true",
              "trainer.max_steps=1", "+callbacks.dump._target_=cli_helpers.DumpGradients")
    run_cli(tmp_path / "fsdp2", *common, "strategy=fsdp2", "trainer.devices=2", f"+callbacks.dump.path={tmp_path / 'g2'}")
    run_cli(tmp_path / "one", *common, "trainer.devices=1", "trainer.accumulate_grad_batches=2", f"+callbacks.dump.path={tmp_path / 'g1'}")
    got, expected = torch.load(tmp_path / "g2" / "rank0.pt"), torch.load(tmp_path / "g1" / "rank0.pt")
    assert got.keys() == expected.keys() and any("experts" in n for n in expected)
    for name, g in expected.items():
        if "lora_A" in name:  # lora_B is zero at the first step, so lora_A's gradient is zero
            continue
        cosine = torch.nn.functional.cosine_similarity(got[name].double().flatten(), g.double().flatten(), dim=0)
        assert cosine > 0.999, (name, float(cosine))
    (loss2,), (loss1,) = summary(tmp_path / "fsdp2")["step_losses"], summary(tmp_path / "one")["step_losses"]
    assert abs(loss2 - loss1) <= 1e-2 * abs(loss1), (loss2, loss1)
    assert summary(tmp_path / "fsdp2")["world_size"] == 2
    assert (tmp_path / "fsdp2" / "adapter" / "adapter_model.safetensors").exists()
    assert Path(summary(tmp_path / "fsdp2")["checkpoint_path"]).is_file()


@pytest.mark.slow
def test_sigterm_to_every_fsdp2_process_stops_them_at_a_step_end_and_resumes(tmp_path):
    """Both processes signalled mid-accumulation: they finish the step, save it (a collective save under FSDP2) and
    stop with status 143; the run resumes from that step."""
    common = (*FAST, "strategy=fsdp2", "trainer.devices=2", "trainer.accumulate_grad_batches=2")
    proc = run_cli(tmp_path, *common, "trainer.max_steps=50", "+callbacks.term._target_=cli_helpers.SignalAtStep",
                   "+callbacks.term.step=2", ok=False)
    assert proc.returncode == 143 and "interrupted: training stopped at step 3 by SIGTERM; resume from" in proc.stderr
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 3
    run_cli(tmp_path, *common, "trainer.max_steps=5", "ckpt_path=last")
    assert summary(tmp_path)["status"] == "completed" and summary(tmp_path)["steps"] == 5
