"""Exact loss normalisation, the PEFT round trip, the fused kernels' math, and skipped steps."""

import math
import types
from functools import partial

import lightning as L
import pytest

import torch

from lightning_ft.data.packing import collate_packed
from lightning_ft.model.build import ModelBuilder
from lightning_ft.module import FinetuneModule
from lightning_ft.model.patching import revert_kernels

from tiny_model import LORA, TINY_MODEL


class _FakeTrainer:
    accumulate_grad_batches = 1
    world_size = 1


def _module():
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model=TINY_MODEL, lora=LORA))
    module.configure_model()
    for name, p in module.model.named_parameters():  # make lora_B non-zero so every LoRA weight gets gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return module


def _grads(module):
    return {n: p.grad.clone() for n, p in module.model.named_parameters() if p.requires_grad}


def _docs(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, 64, (n,), generator=g).tolist()
        out.append((ids, [-100] * (n // 2) + ids[n // 2 :]))
    return out


def test_accumulation_of_uneven_micro_batches_equals_one_batch(monkeypatch):
    micro = [_docs([30, 3], 1), _docs([5], 2), _docs([17, 9, 2], 3), _docs([40], 4)]
    whole = collate_packed([d for m in micro for d in m])

    module = _module()
    monkeypatch.setattr(FinetuneModule, "trainer", _FakeTrainer(), raising=False)
    _FakeTrainer.accumulate_grad_batches = 1
    module.training_step(whole, 0).backward()
    expected = _grads(module)
    module.model.zero_grad(set_to_none=True)

    _FakeTrainer.accumulate_grad_batches = len(micro)
    step_tokens = sum(len(ids) for m in micro for ids, _ in m)
    for i, docs in enumerate(micro):
        batch = collate_packed(docs, step_tokens=step_tokens, step_target_tokens=whole.num_target_tokens)
        (module.training_step(batch, i) / len(micro)).backward()  # Lightning divides by k
    got = _grads(module)
    assert expected.keys() == got.keys() and len(got) > 0
    for name in expected:
        assert expected[name].abs().sum() > 0, name
        # fp32 sums over other row splits: ~1e-8 apart, depending on the CPU
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_rows_padded_for_the_graphs_give_the_same_loss_and_gradients():
    """`FinetuneModule.pad_for_graphs` (on with graphed varlen layers, a GPU setting, forced here):
    the padding document changes neither the loss sum nor any gradient; rows of several documents
    are padded to a multiple of 256 tokens, never below the largest count so far, nor past the
    data module's max_tokens; a one-document row is left alone."""
    from lightning_ft.module import GRAPH_TOKEN_MULTIPLE

    module = _module()
    lengths = [[30, 3], [290, 10], [17, 9, 2], [300], [600, 50]]
    batches = [collate_packed(_docs(row, seed)) for seed, row in enumerate(lengths)]
    assert module.pad_for_graphs(batches[0]) is batches[0]  # off unless the graphs replay varlen layers
    module._graph_tokens = 0
    module._trainer = types.SimpleNamespace(datamodule=types.SimpleNamespace(max_tokens=700))
    padded = [module.pad_for_graphs(b) for b in batches]
    module._trainer = None
    assert [p.num_tokens for p in padded] == [GRAPH_TOKEN_MULTIPLE, 2 * GRAPH_TOKEN_MULTIPLE, 2 * GRAPH_TOKEN_MULTIPLE, 300, 700]
    assert padded[3] is batches[3]
    for batch, pad in zip(batches, padded):
        results = []
        for b in (batch, pad):
            loss = module.loss_sum(b)
            loss.backward()
            results.append((loss.detach(), _grads(module)))
            module.model.zero_grad(set_to_none=True)
        (want_loss, want), (got_loss, got) = results
        assert torch.allclose(got_loss, want_loss, rtol=1e-6)
        # fp32 weight gradients summed over more rows (the padding's are zero): summation order only
        assert all((got[n] - want[n]).norm() <= 1e-5 * want[n].norm() for n in want)


def test_exported_adapter_loads_with_peft_and_reproduces_logits(tmp_path):
    from peft import PeftModel

    from lightning_ft.model.build import load_causal_lm

    module = _module()
    module.model.save_pretrained(tmp_path)
    batch = collate_packed(_docs([11, 6], 7))
    with torch.no_grad():
        ours = module.model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch).logits
        torch.manual_seed(0)
        base = load_causal_lm(None, "random", dict(TINY_MODEL["config"]), attn_implementation="sdpa")
        peft_model = PeftModel.from_pretrained(base, tmp_path).eval()
        # stock transformers + PEFT on each document alone (no packing, stock SDPA attention)
        offsets = batch.cu_seqlens.tolist()
        theirs = torch.cat(
            [peft_model(input_ids=batch.input_ids[:, a:b]).logits for a, b in zip(offsets[:-1], offsets[1:])], dim=1
        )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("init_from", [False, True])
def test_a_loaded_checkpoint_trains_in_training_mode(tmp_path, init_from):
    # from_pretrained returns eval mode and Lightning keeps submodule modes: a module left in eval mode
    # trains with gradient checkpointing silently off (transformers checkpoints only in training mode)
    torch.manual_seed(0)
    random_model = FinetuneModule(ModelBuilder(model=TINY_MODEL, lora=LORA))
    random_model.configure_model()
    base = random_model.model.get_base_model()
    base.save_pretrained(tmp_path / "base")
    random_model.model.save_pretrained(tmp_path / "adapter")
    lora = {**LORA, "init_from": str(tmp_path / "adapter")} if init_from else LORA
    model_cfg = {"init": "pretrained", "name_or_path": str(tmp_path / "base"), "gradient_checkpointing": True}
    module = FinetuneModule(ModelBuilder(model=model_cfg, lora=lora))
    module.configure_model()
    in_eval = [name for name, m in module.model.named_modules() if not m.training]
    assert not in_eval, f"{len(in_eval)} modules in eval mode, e.g. {in_eval[:3]}"
    layer = module.model.get_base_model().model.layers[0]
    assert layer.gradient_checkpointing and layer.training  # transformers checkpoints this layer


def test_kernels_all_gives_the_stock_loss_and_lora_gradients():
    """fp32: the fused kernels compute the same math, so 1e-5 holds (bf16 tolerances: tests/model/test_patching.py)."""
    batch = collate_packed(_docs([9, 1, 14], 5))
    results = []
    for kernels in ({}, {"rms_norm": True, "rope": True, "swiglu": True, "lora": True, "fused_linear_cross_entropy": True}):
        torch.manual_seed(0)
        module = FinetuneModule(ModelBuilder(model=TINY_MODEL, lora=LORA, kernels=kernels))
        module.configure_model()
        for i, (name, p) in enumerate(module.model.named_parameters()):
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(i))
        loss = module.loss_sum(batch)
        loss.backward()
        revert_kernels(module.model)  # the RoPE patch is process-wide
        results.append((loss.detach(), _grads(module)))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_step_without_target_tokens_is_skipped_and_counted():
    """Every label of step 1 masked: no NaN, no update (AdamW never sees a gradient), counted; step 2 trains."""
    import lightning as L
    from torch.utils.data import DataLoader

    masked = collate_packed([([1, 2, 3, 4], [-100] * 4), ([5, 6], [-100, -100])])
    assert masked.step_target_tokens == 0
    loader = DataLoader([masked, collate_packed(_docs([12, 7], 11))], batch_size=1, collate_fn=lambda items: items[0])
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model=TINY_MODEL, lora=LORA), optimizer=partial(torch.optim.AdamW, lr=1e-2))
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader)
    assert module.skipped_steps == {"no_target_tokens": 1, "nonfinite": 0}
    assert module.step_losses[0] is None and math.isfinite(module.step_losses[1])
    optimizer = trainer.optimizers[0]
    assert {int(optimizer.state[p]["step"]) for p in module.model.parameters() if p.requires_grad} == {1}


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_logged_step_values_stay_on_the_host(accelerator, monkeypatch):
    """train/loss and train/tokens_per_s reach ``self.log`` as host tensors (`host_scalar`), not
    floats: Lightning makes a logged float a tensor on the module's device (a blocking copy, then
    ``.item()`` back for the progress bar), two host syncs per value and step. The values are the step's."""
    from torch.utils.data import DataLoader

    from lightning_ft.callbacks.throughput import TokenThroughput

    logged = []
    log = L.LightningModule.log
    monkeypatch.setattr(L.LightningModule, "log", lambda self, name, value, **kw: logged.append((name, value)) or log(self, name, value, **kw))

    loader = DataLoader([collate_packed(_docs([12, 7], seed)) for seed in (11, 12)], batch_size=1, collate_fn=lambda items: items[0])
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model=TINY_MODEL, lora=LORA), optimizer=partial(torch.optim.AdamW, lr=1e-2))
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[TokenThroughput()])
    trainer.fit(module, train_dataloaders=loader)
    assert sorted({name for name, _ in logged}) == ["train/loss", "train/tokens_per_s"] and len(logged) == 4
    assert all(isinstance(value, torch.Tensor) and value.device.type == "cpu" for _, value in logged), logged
    metrics = trainer.callback_metrics
    assert metrics["train/loss"].device.type == "cpu" and metrics["train/tokens_per_s"].device.type == "cpu"
    assert metrics["train/loss"].item() == pytest.approx(module.step_losses[-1], rel=1e-6)
    assert metrics["train/tokens_per_s"].item() > 0


def _train_with_a_nan_step(fused: bool, on_nonfinite: str = "skip", accelerator: str = "cpu", nan_batch: int = 1,
                           optimizer=torch.optim.AdamW, **optimizer_args):
    """Three steps of ``optimizer`` (lr 1e-2), batch ``nan_batch``'s loss NaN (its LM head NaN for that batch)."""
    import lightning as L
    from torch.utils.data import DataLoader

    class NaNAtStep2(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == nan_batch:
                self.saved = pl_module.hf_model.get_output_embeddings().weight.detach().clone()
                pl_module.hf_model.get_output_embeddings().weight.data.fill_(math.nan)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == nan_batch:
                pl_module.hf_model.get_output_embeddings().weight.data.copy_(self.saved)

    batches = [collate_packed(_docs([12, 7], seed)) for seed in (11, 12, 13)]
    loader = DataLoader(batches, batch_size=1, collate_fn=lambda items: items[0])
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model=TINY_MODEL, lora=LORA), optimizer=partial(optimizer, lr=1e-2, fused=fused, **optimizer_args), on_nonfinite=on_nonfinite)
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=3, logger=False, enable_checkpointing=False, callbacks=[NaNAtStep2()],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    return module, trainer, loader


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_fused_optimizer_skips_a_nonfinite_step_on_the_device_like_the_host_skip(accelerator):
    """Fused AdamW gets the flag as found_inf (no host read before the update; on CUDA read back
    from pinned memory after it): the same weights and moments as the host path, which sets the
    gradients to None; the flag is removed after each step."""
    results = []
    for fused in (False, True):
        module, trainer, loader = _train_with_a_nan_step(fused, accelerator=accelerator)
        trainer.fit(module, train_dataloaders=loader)
        optimizer = trainer.optimizers[0]
        assert module.skipped_steps == {"no_target_tokens": 0, "nonfinite": 1}
        assert module.step_losses[1] is None and all(math.isfinite(x) for x in module.step_losses[::2])
        assert {int(optimizer.state[p]["step"]) for p in module.model.parameters() if p.requires_grad} == {2}
        assert not hasattr(optimizer, "found_inf")
        results.append(({n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad},
                        module.step_losses))
    (ref, ref_losses), (got, losses) = results
    for name in ref:  # fused and foreach AdamW round differently: m / (sqrt(v) + eps) of a near-zero gradient
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=5e-5, msg=name)
    assert losses[2] == pytest.approx(ref_losses[2], rel=1e-5)


def test_a_fused_optimizer_stops_on_a_nonfinite_step_without_updating():
    from lightning_ft.errors import TrainingStopped

    module, trainer, loader = _train_with_a_nan_step(True, on_nonfinite="stop")
    before = {}

    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                before.update({n: p.detach().clone() for n, p in pl_module.model.named_parameters() if p.requires_grad})

    trainer.callbacks.append(Snapshot())
    with pytest.raises(TrainingStopped, match="non-finite loss or gradient at optimizer step 2.*without updating the weights"):
        trainer.fit(module, train_dataloaders=loader)
    assert len(module.step_losses) == 1 and before
    for name, p in module.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, msg=name)


def test_fused_sgd_is_not_skipped_on_the_device():
    """torch's fused SGD makes its momentum buffers with empty_like in its first step; skipped there
    by found_inf, they stay garbage: such optimizers take the host read and skip by dropping the
    gradients, so the run matches unfused SGD."""
    results = []
    for fused in (False, True):
        module, trainer, loader = _train_with_a_nan_step(fused, nan_batch=0, optimizer=torch.optim.SGD, momentum=0.9)
        trainer.fit(module, train_dataloaders=loader)
        assert module.step_losses[0] is None and module.skipped_steps["nonfinite"] == 1
        results.append({n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad})
    for name, ref in results[0].items():
        assert torch.isfinite(results[1][name]).all(), name
        torch.testing.assert_close(results[1][name], ref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_mixed_clips_gradients_with_a_fused_optimizer(fused):
    """Lightning's MixedPrecision refuses to clip for any fused optimizer (for fp16's GradScaler);
    bf16-mixed has none, so we clip as its base class does: the same weights as foreach AdamW."""
    import lightning as L
    from torch.utils.data import DataLoader

    def train(fused: bool, clip: float | None):
        loader = DataLoader([collate_packed(_docs([12, 7], seed)) for seed in (11, 12)], batch_size=1,
                            collate_fn=lambda items: items[0])
        torch.manual_seed(0)
        module = FinetuneModule(ModelBuilder(model=TINY_MODEL, lora=LORA), optimizer=partial(torch.optim.AdamW, lr=1e-2, fused=fused))
        trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, precision="bf16-mixed",
                            gradient_clip_val=clip, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(module, train_dataloaders=loader)
        return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}

    clipped = train(fused, 1e-3)
    reference = train(False, 1e-3) if fused else train(False, None)
    for name in clipped:
        if fused:  # fused and foreach AdamW round differently: m / (sqrt(v) + eps) of a near-zero gradient
            torch.testing.assert_close(clipped[name], reference[name], rtol=1e-5, atol=5e-5, msg=name)
    if not fused:  # the clip takes effect (Adam's first steps are nearly scale-free, so compare step 2's moments' effect)
        assert any(not torch.allclose(clipped[n], reference[n]) for n in clipped)


def test_mixed_precision_skips_peft_input_casts_with_the_same_result():
    """Under bf16 autocast PEFT's cast of each LoRA input to fp32 changes nothing but costs copies."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from lightning_ft.model.lora import _skip_adapter_input_casts

    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model={**TINY_MODEL, "dtype": "bfloat16"}, lora=LORA))  # bf16 base, fp32 adapters
    module.configure_model()
    for name, p in module.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    assert {p.dtype for p in module.model.parameters() if p.requires_grad} == {torch.float32}
    batch = collate_packed(_docs([9, 5], seed=0))
    losses = []
    for skip in (False, True):
        if skip:
            _skip_adapter_input_casts(module.model)
        module.model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module.loss_sum(batch)
        loss.backward()
        losses.append((loss.detach(), _grads(module)))
    layers = [m for m in module.model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers and not any(m.cast_input_dtype_enabled for m in layers)
    assert torch.equal(losses[0][0], losses[1][0])
    for name, grad in losses[0][1].items():
        assert torch.equal(grad, losses[1][1][name]), name


def test_gradients_are_freed_right_after_the_optimizer_step_and_still_accumulate():
    """Lightning zeroes gradients only after the next step's forward; ours are gone at the step's end.
    Two micro-batches per step: the first's gradient survives into the second's (accumulation)."""
    import lightning as L

    seen = []

    class Watch(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(("step", all(p.grad is not None for p in optimizer.param_groups[0]["params"])))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            params = [p for p in pl_module.model.parameters() if p.requires_grad]
            seen.append(("end", sum(p.grad is not None for p in params), len(params)))

    module = _module()
    module.model = None  # built by the Trainer, as in a run
    module.optimizer_factory = partial(torch.optim.AdamW, lr=1e-3)
    before = None

    class Keep(L.Callback):
        def on_train_start(self, trainer, pl_module):
            nonlocal before
            before = {n: p.detach().clone() for n, p in pl_module.model.named_parameters() if p.requires_grad}

    micro = [_docs([12, 5], seed) for seed in range(4)]
    batches = [collate_packed(docs, step_tokens=34, step_target_tokens=17) for docs in micro]
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch(), Keep()],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    params = len(before)
    # micro-batch 1: gradients kept for micro-batch 2; then the step sees them all and frees them
    assert seen == [("end", params, params), ("step", True), ("end", 0, params)] * 2
    after = dict(module.model.named_parameters())
    assert all(not torch.equal(before[n], after[n].detach()) for n in before)


@pytest.mark.parametrize(
    ("scheduler", "lrs"),
    [
        # warm-up over 2 steps, then constant: no num_training_steps in its signature
        ("get_constant_schedule_with_warmup", [0.0, 0.5e-2, 1e-2, 1e-2]),
        # warm-up over 2 steps, then cosine to 0 at num_training_steps=4 (Lightning's estimated_stepping_batches)
        ("get_cosine_schedule_with_warmup", [0.0, 0.5e-2, 1e-2, 0.5e-2]),
    ],
)
def test_the_scheduler_gets_num_training_steps_only_where_it_takes_it(scheduler, lrs):
    """The LR of each of 4 optimizer steps, as the scheduler's own formula gives it."""
    import transformers
    from torch.utils.data import DataLoader

    seen = []

    class LRs(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(optimizer.param_groups[0]["lr"])

    loader = DataLoader([collate_packed(_docs([12, 7], seed)) for seed in range(4)], batch_size=None)
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model=TINY_MODEL, lora=LORA), optimizer=partial(torch.optim.AdamW, lr=1e-2), scheduler=partial(getattr(transformers, scheduler), num_warmup_steps=2))
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, callbacks=[LRs()],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader)
    assert seen == pytest.approx(lrs, abs=1e-12)


def test_a_scheduler_missing_an_argument_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match=r"^scheduler._target_=torch.optim.lr_scheduler.StepLR: needs step_size, which nothing "
                                         r"sets: add \+scheduler.step_size=\.\.\.$"):
        FinetuneModule(ModelBuilder(model=TINY_MODEL, lora=LORA), scheduler=partial(torch.optim.lr_scheduler.StepLR, gamma=0.5))


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("lora.target_modules=q_proj", "error: lora.target_modules='q_proj' matches no module: a string is a regular expression"),
        ("model.config.num_hidden_layers=abc", "error: model.config.num_hidden_layers='abc': expected int, got str (value: 'abc')"),
    ],
)
def test_the_cli_prints_the_bad_config_key_without_a_traceback(tmp_path, override, line):
    """A bad config value: one line from the CLI (our ValueError), not PEFT's or huggingface_hub's traceback."""
    from cli_helpers import FAST, run_cli

    proc = run_cli(tmp_path, override, "trainer.max_steps=2", *FAST, ok=False)
    assert line in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


class _Counted(Exception):
    """Raised by `_CountSteps.configure_optimizers` with (`training_steps`, Lightning's estimated_stepping_batches)."""


@pytest.mark.parametrize(
    ("max_epochs", "max_steps", "accumulate", "limit"),
    [(2, -1, 1, 1.0), (3, -1, 2, 1.0), (3, 10, 2, 1.0), (None, -1, 1, 1.0), (-1, 20, 1, 1.0), (2, -1, 2, 0.5), (2, -1, 3, 4)],
)
def test_training_steps_counts_as_lightning_does_without_the_train_loader(max_epochs, max_steps, accumulate, limit):
    """15 packed rows; `training_steps` is read before Lightning's own count, which then sets the loader up."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_ft.data.datamodule import PackedDataModule
    from lightning_ft.data.tokenization import load_tokenizer
    from lightning_ft.module import training_steps

    class _CountSteps(BoringModel):
        def configure_optimizers(self):
            ours = training_steps(self.trainer)
            assert self.trainer.train_dataloader is None  # not set up for it
            raise _Counted(ours, self.trainer.estimated_stepping_batches)

    data = PackedDataModule(load_tokenizer("builtin"), num_examples=60, max_tokens=128, accumulate_grad_batches=accumulate)
    trainer = L.Trainer(accelerator="cpu", max_epochs=max_epochs, max_steps=max_steps, accumulate_grad_batches=accumulate,
                        limit_train_batches=limit, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    with pytest.raises(_Counted) as counted:
        trainer.fit(_CountSteps(), datamodule=data)
    ours, lightnings = counted.value.args
    assert ours == lightnings and data.train_batches_per_epoch() == 15


def test_the_packed_loss_builds_no_transformers_attention_mask(monkeypatch):
    """A packed row's attention masks come from its offsets: transformers' [T, T] mask is never built for it, nor its
    packed-sequence detection run (a device sync)."""
    from transformers import masking_utils

    module = _module()
    calls = []
    for name in ("sdpa_mask", "find_packed_sequence_indices"):
        monkeypatch.setattr(masking_utils, name, lambda *args, **kwargs: calls.append(args))
    module.loss_terms(collate_packed(_docs([7, 5], seed=0)), aux=False)
    assert not calls


@pytest.mark.parametrize("longest, limit, warned", [(33, 32, True), (32, 32, False), (5000, None, False)])
def test_a_document_past_the_models_positions_is_warned_about(longest, limit, warned):
    import warnings
    from types import SimpleNamespace

    from lightning_ft.module import warn_positions_past_limit

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_positions_past_limit(longest, SimpleNamespace(max_position_embeddings=limit))
    messages = [str(w.message) for w in caught]
    expected = [f"a document of {longest} tokens is longer than the model's max_position_embeddings={limit}"] if warned else []
    assert [m.split(":")[0] for m in messages] == expected
