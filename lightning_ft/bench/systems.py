"""The systems a benchmark compares, each building a model and taking training steps its own way.

- ``hf_peft``: stock transformers + PEFT as a user writes it: SDPA attention, the ``grouped_mm``
  experts implementation for MoE, PEFT ``target_parameters`` for expert LoRA, non-reentrant
  gradient checkpointing, bf16 weights under bf16 autocast (fp32 adapters), AdamW on the adapters,
  ``model(input_ids, labels=input_ids).loss``. The baseline of every ratio. With ``model.quantization=nf4``
  (QLoRA) its linear layers are bitsandbytes' NF4 ``Linear4bit`` (double quantisation, computing in the model's
  dtype), as ``from_pretrained`` with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  bnb_4bit_use_double_quant=True)`` makes them, and PEFT's ``lora.bnb.Linear4bit`` adapters; norms, embeddings
  and the LM head stay in the model's dtype (``prepare_model_for_kbit_training``'s fp32 upcast is left out: it
  would only make this baseline slower and larger).
- ``liger``: the same after Liger Kernel's ``apply_liger_kernel_to_<arch>()``.
- ``unsloth``: Unsloth's ``FastLanguageModel`` (16-bit LoRA, ``use_gradient_checkpointing=
  "unsloth"``) loaded from a checkpoint folder of the same random weights, then the same loop as
  ``hf_peft``. Its first step compiles every layer, so give it ≥ 2 warm-up steps. With
  ``model.quantization=nf4``, Unsloth's QLoRA: ``load_in_4bit=True`` (it quantises the checkpoint to NF4 as
  it loads).
- ``lightning_ft``: our `FinetuneModule` with the benchmark's kernels config, the model
  config's ``attention`` and the ``strategy`` options (CUDA graphs, kept and offloaded activations),
  trained by a Lightning `Trainer` with the lightning_ft strategy exactly as ``fit``
  does (the step time includes Lightning's loop; with CUDA graphs, give it >= 2 warm-up steps:
  the second records them).

Every system sees the same batch: one sequence of ``seq_len`` random tokens (seeded), batch 1, and
the same random base weights (drawn from the same seeded RNG state).

Note: this module imports nothing but torch when imported; transformers, PEFT, Lightning (which
imports transformers through torchmetrics) and the peers are imported inside the functions. Unsloth
patches transformers, PEFT and TRL and sets the CUDA allocator's config when it is imported, so in
the ``unsloth`` worker `import_unsloth` must run before any of them and before CUDA is touched.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from lightning_ft.bench.flops import num_experts

SYSTEMS = ("hf_peft", "liger", "unsloth", "lightning_ft")

_LIGER_PATCHES = {"llama": "apply_liger_kernel_to_llama", "qwen3": "apply_liger_kernel_to_qwen3",
                  "qwen3_moe": "apply_liger_kernel_to_qwen3_moe"}
#: what a user does when a peer is not installed (pyproject.toml's `bench` extra holds liger-kernel, unsloth, unsloth_zoo)
_INSTALL_HINT = '; install the peers with pip install -e ".[bench]" (needs a CUDA GPU for unsloth)'


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _autocast(device: str) -> torch.autocast:
    """bf16 autocast on CUDA (as a bf16 `Trainer` runs), none on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu", enabled=False)


def _random_model(spec: dict[str, Any], **kwargs: Any) -> torch.nn.Module:
    """The spec's architecture with random weights from the current (seeded) RNG, on ``spec["device"]`` in ``spec["dtype"]``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(spec["model_config"])
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(spec["device"]):
        return AutoModelForCausalLM.from_config(hf_config, dtype=spec["dtype"], **kwargs)


def _nf4(spec: dict[str, Any]) -> bool:
    """Whether the bench runs QLoRA: the frozen base in NF4 (``model.quantization=nf4``) for every system."""
    return spec.get("model_options", {}).get("quantization", "none") == "nf4"


def _hf_model(spec: dict[str, Any]) -> torch.nn.Module:
    """The stock model as a transformers user runs it: SDPA attention where the class has it (gpt-oss has not: its
    sinks run in eager attention, transformers' default for it), the experts through ``grouped_mm`` on CUDA."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(spec["model_config"])
    architecture = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(cfg["model_type"]))]
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa" if architecture._supports_sdpa else "eager"}
    if num_experts(cfg) and spec["device"].startswith("cuda"):
        kwargs["experts_implementation"] = "grouped_mm"
    model = _random_model(spec, **kwargs)
    if _nf4(spec):  # the bitsandbytes Linear4bit layers from_pretrained(quantization_config=...) makes
        from lightning_ft.model.quantization import quantize_linears

        quantize_linears(model)
    if spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def adamw(params: list[torch.nn.Parameter], spec: dict[str, Any]) -> torch.optim.AdamW:
    """Every system's optimizer: AdamW, lr 1e-4, fused on CUDA (one kernel per step and no
    temporaries; the foreach default holds a copy of every trainable tensor during the step)."""
    return torch.optim.AdamW(params, lr=1e-4, fused=spec["device"].startswith("cuda"))


def _train(model: torch.nn.Module, spec: dict[str, Any], input_ids: torch.Tensor, num_steps: int) -> tuple[list[float], float, dict]:
    """The plain training loop of ``hf_peft``, ``liger`` and ``unsloth``: forward under autocast with
    ``labels=input_ids``, backward, `adamw` on the trainable parameters; returns (seconds per step,
    last loss, profile summary)."""
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], spec)
    timer = StepTimer(spec)
    loss = torch.zeros(())
    for _ in range(num_steps):
        timer.on_train_batch_start()
        with _autocast(spec["device"]):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        timer.on_before_backward()
        loss.backward()
        timer.on_after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.on_train_batch_end()
    timer.on_train_end()
    return timer.times, float(loss), timer.summary


def hf_peft_steps(spec: dict[str, Any], input_ids: torch.Tensor, num_steps: int, liger: bool = False) -> tuple[list[float], float, dict]:
    """Run ``num_steps`` training steps of stock transformers + PEFT; returns (seconds per step, last loss, profile summary)."""
    if liger:
        try:
            import liger_kernel.transformers as lk
        except ModuleNotFoundError as err:
            raise ImportError(f"liger-kernel not importable: {type(err).__name__}: {err}{_INSTALL_HINT}") from err

        getattr(lk, _LIGER_PATCHES[spec["model_config"]["model_type"]])()
    from lightning_ft.model.lora import add_lora

    return _train(add_lora(_hf_model(spec), spec["lora"]), spec, input_ids, num_steps)


def import_unsloth() -> Any:
    """Import Unsloth offline and return its ``FastLanguageModel``; a no-op after the first call.

    The first call must come before anything imports transformers, PEFT or TRL (Unsloth patches
    them on import) and before CUDA is initialised (Unsloth sets ``PYTORCH_ALLOC_CONF`` on import),
    which is why the worker calls it before drawing the tokens. It sets the Hugging Face offline
    variables (the checkpoint is a local folder), ``UNSLOTH_DISABLE_STATISTICS`` (no statistics
    download), ``UNSLOTH_DISABLE_CPU_FALLBACK`` (without a GPU, fail instead of training stock
    transformers on the CPU under Unsloth's name) and, unless set, ``UNSLOTH_COMPILE_LOCATION`` to
    the temp folder (instead of ``./unsloth_compiled_cache``). Source: unsloth 2026.10.9
    ``unsloth/_gpu_init.py``, ``unsloth_zoo/__init__.py``, ``unsloth/models/_utils.py``
    (``get_statistics``), ``unsloth_zoo/device_type.py`` (``cpu_backend_allowed``).

    Raises:
        RuntimeError: transformers, PEFT or TRL is imported or CUDA is initialised already.
        ImportError: Unsloth fails to import (not installed, a missing dependency, no GPU); the
            message gives Unsloth's reason on one line.
    """
    if "unsloth" not in sys.modules:
        early = [m for m in ("transformers", "peft", "trl") if m in sys.modules]
        early += ["CUDA"] if torch.cuda.is_initialized() else []
        if early:
            raise RuntimeError(f"unsloth must be imported before {', '.join(early)} (it patches them when imported): "
                               "call import_unsloth() first in the process")
        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                          UNSLOTH_DISABLE_STATISTICS="1", UNSLOTH_DISABLE_CPU_FALLBACK="1")
        os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(tempfile.gettempdir(), "unsloth_compiled_cache"))
    try:
        from unsloth import FastLanguageModel
    except Exception as err:  # Unsloth raises NotImplementedError, RuntimeError, ... for an unusable machine
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:180]
        hint = _INSTALL_HINT if isinstance(err, ModuleNotFoundError) else ""
        raise ImportError(f"unsloth not importable: {reason}{hint}") from err
    return FastLanguageModel


def unsloth_steps(spec: dict[str, Any], input_ids: torch.Tensor, num_steps: int) -> tuple[list[float], float, dict]:
    """Run ``num_steps`` training steps of Unsloth's 16-bit LoRA (QLoRA with ``model.quantization=nf4``); returns
    (seconds per step, last loss, profile summary).

    ``FastLanguageModel`` dispatches on ``model_type``: Llama loads through ``FastLlamaModel`` (Unsloth's
    hand-written Triton kernels), Qwen3-MoE through ``FastModel`` (its compiler, which compiles each
    layer on the first step) (``unsloth/models/loader.py``).

    Unsloth loads only from a checkpoint folder with a tokenizer, so the spec's random model (the
    same weights ``hf_peft`` draws) is saved in ``spec["dtype"]`` as safetensors, with the project's
    built-in tokenizer, to a temporary folder on local disk (``$TMPDIR``; 16 GB for 12 layers of
    Qwen3-30B-A3B), deleted at the end. The tokenizer's 512 tokens are fewer than the model's vocab:
    Unsloth grows the embedding only when the tokenizer is longer, and keeps ``vocab_size``
    otherwise (``unsloth_zoo/patching_utils.py``, ``patch_model_and_tokenizer``).

    LoRA: ``lora.target_modules`` go to ``get_peft_model(target_modules=...)`` and
    ``lora.target_parameters`` (the 3-D expert weights ``mlp.experts.gate_up_proj`` /
    ``mlp.experts.down_proj``) to its ``target_parameters=...``, Unsloth's argument for MoE expert
    parameters, which become the same PEFT ``ParamWrapper`` adapters ``hf_peft`` trains and which
    Unsloth's grouped-GEMM MoE backend reads (``unsloth/models/vision.py``,
    ``FastBaseModel.get_peft_model``; ``unsloth_zoo/temporary_patches/qwen3_moe.py``).
    Gradient checkpointing is Unsloth's own ``"unsloth"`` mode (offloads the checkpoints to the
    host). The peak memory is counted from the load on (the random model written out is freed).
    The adapters start from Unsloth's own seed (``random_state``), so after the first step the
    losses differ slightly from ``hf_peft``'s.

    Raises:
        ImportError, RuntimeError: see `import_unsloth`.
        ValueError: ``lora.enabled`` is false (this system compares LoRA only).
    """
    if not spec["lora"].get("enabled", True):
        raise ValueError("the unsloth system runs LoRA only: set lora.enabled=true or leave unsloth out of systems")
    FastLanguageModel = import_unsloth()
    from lightning_ft.data.tokenization import BUILTIN_TOKENIZER, load_tokenizer

    lora = spec["lora"]
    checkpointing = "unsloth" if spec["gradient_checkpointing"] else False
    with tempfile.TemporaryDirectory(prefix="lightning_ft_unsloth_") as checkpoint:
        _random_model(spec).save_pretrained(checkpoint)
        load_tokenizer(BUILTIN_TOKENIZER).save_pretrained(checkpoint)
        gc.collect()  # the random model written out: free it before Unsloth loads its copy
        if spec["device"].startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model, _ = FastLanguageModel.from_pretrained(
            model_name=checkpoint, max_seq_length=spec["seq_len"], dtype=spec["dtype"], load_in_4bit=_nf4(spec),
            load_in_8bit=False, load_in_16bit=not _nf4(spec), full_finetuning=False, use_gradient_checkpointing=checkpointing,
        )
        model = FastLanguageModel.get_peft_model(
            model,
            r=lora["rank"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"] if isinstance(lora["target_modules"], str) else list(lora["target_modules"]),
            target_parameters=list(lora["target_parameters"]) if lora.get("target_parameters") else None,
            bias="none",
            use_gradient_checkpointing=checkpointing,
        )
        FastLanguageModel.for_training(model)
        return _train(model, spec, input_ids, num_steps)


def lightning_ft_steps(spec: dict[str, Any], input_ids: torch.Tensor, num_steps: int) -> tuple[list[float], float, dict]:
    """Run ``num_steps`` steps of `FinetuneModule` under a Lightning `Trainer`; returns (seconds per step, last loss, summary).

    The summary has `StepTimer`'s entries, with a memory plan its predicted peak (``predicted_peak_gib``) and,
    with CUDA graphs, `cuda_graph_stats` prefixed ``cuda_graphs_`` (layer calls replayed, bytes of attention outputs
    and of attention's and the MLP's projection outputs kept; with activation offloading the copies' achieved GB/s and the compute stream's wait on
    them per forward, warm-up steps included: `lightning_ft.strategies.offload.CopyMeter.stats`).
    """
    import lightning as L

    from lightning_ft.data.packing import collate_packed
    from lightning_ft.strategies.cuda_graphs import cuda_graph_stats
    from lightning_ft.model.build import ModelBuilder
    from lightning_ft.module import FinetuneModule
    from lightning_ft.strategies.strategy import Execution, SingleDeviceStrategy

    class StepTimerCallback(StepTimer, L.Callback):
        """`StepTimer` as a Lightning callback (its hooks take Lightning's arguments)."""

    ids = input_ids[0].tolist()
    batch = collate_packed([(ids, ids)])
    timer = StepTimerCallback(spec)
    builder = ModelBuilder(
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
    )
    module = FinetuneModule(builder, optimizer=lambda params: adamw(params, spec))
    cuda = spec["device"].startswith("cuda")
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=SingleDeviceStrategy(execution=Execution.from_config(spec.get("strategy"))),
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
    graphs = cuda_graph_stats(module.model) or {}  # how many layers replayed, what they kept (bytes)
    plan = trainer.strategy.memory_plan  # the memory plan (strategy.memory_budget_gib), if one was made
    predicted = {"predicted_peak_gib": plan.peak_bytes / 2**30} if plan is not None else {}
    return timer.times, module.step_losses[-1], {**timer.summary, **predicted, **{f"cuda_graphs_{k}": v for k, v in graphs.items()}}


class StepTimer:
    """Times each training batch with the device synchronised at both ends; peak memory per phase.

    Plain loops call the hooks themselves; `lightning_ft_steps` mixes it into a Lightning callback
    (not subclassed here: importing Lightning imports transformers, see the module docstring).

    On CUDA, `summary` also gets the peak allocated memory (GiB) of each phase of the timed steps
    (``peak_mem_gib_forward``: from the batch's start to its backward, ``_backward``,
    ``_optimizer``: the optimizer step to the batch's end) and of everything before them
    (``peak_mem_gib_warmup``: the warm-up steps: compilation, graph recording), and the run's peaks so
    far (``peak_mem_gib``, and ``peak_reserved_gib``: allocated plus the allocator's cache). The
    allocator's peaks are reset when the first batch starts (the model and its adapters resident), so
    the build is left out: the systems build differently (Unsloth loads a checkpoint; a 4-bit base is
    drawn in 16 bits and then quantised, where a checkpoint would load layer by layer), and at each phase
    boundary: a run's peak is the larger of these and the allocator's peak since the last reset.

    With ``spec["profile"]`` (a file path) the timed steps (those after ``spec["warmup_steps"]``)
    also run under `torch.profiler`; at the end the file gets the ops ranked by device time and by host time,
    then by input shape (with ``strategy.cuda_graphs=false``: a graph's replay hides its ops), and `summary`
    gets the device-busy time and kernel launches per step (device busy far below the step time means the
    step waits on the host: Python, launches or syncs).
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        self.device = spec["device"]
        self.warmup_steps = spec.get("warmup_steps", 0)
        self.profile_path = spec.get("profile")
        self.times: list[float] = []
        self.summary: dict[str, float] = {}
        self._profiler: torch.profiler.profile | None = None
        self._t0 = 0.0

    def _memory_phase(self, phase: str) -> None:
        if not self.device.startswith("cuda"):
            return
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        key = f"peak_mem_gib_{phase}" if len(self.times) >= self.warmup_steps else "peak_mem_gib_warmup"
        # each step's phases in the worker's output (`lightning_ft.bench.runner` keeps it): where a warm-up peak is
        print(f"bench step {len(self.times) + 1} {phase}: peak {peak / 2**30:.2f} GiB allocated, {reserved / 2**30:.2f} GiB reserved",
              file=sys.stderr, flush=True)
        # peak_reserved_gib: what the allocator held (allocated + cached), what the GPU must have
        for name, value in ((key, peak), ("peak_mem_gib", peak), ("peak_reserved_gib", reserved)):
            self.summary[name] = max(self.summary.get(name, 0.0), value / 2**30)

    def on_before_backward(self, *args: Any) -> None:
        self._memory_phase("forward")

    def on_after_backward(self, *args: Any) -> None:
        self._memory_phase("backward")

    def on_train_batch_start(self, *args: Any) -> None:
        if not self.times and self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()  # the build left out (see the class docstring)
        if self.profile_path and len(self.times) == self.warmup_steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.startswith("cuda"):
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.__enter__()
        _sync(self.device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        _sync(self.device)
        self._memory_phase("optimizer")
        self.times.append(time.perf_counter() - self._t0)

    def on_train_end(self, *args: Any) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        steps = max(1, len(self.times) - self.warmup_steps)
        events = self._profiler.key_averages()
        # kernels and copies; a GPU-side mirror of a host annotation (Lightning's "Optimizer.step#…"
        # spans the whole step) carries the host event's name and is left out
        host_names = {e.key for e in events if e.device_type != torch.autograd.DeviceType.CUDA}
        device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in host_names]
        if device_events:
            self.summary |= {
                "device_busy_ms_per_step": sum(e.self_device_time_total for e in device_events) / 1e3 / steps,
                "kernels_per_step": sum(e.count for e in device_events) / steps,
            }
        # names wide enough to tell the kernels apart (the default cuts them at 55 characters)
        tables = [events.table(sort_by=key, row_limit=60, max_name_column_width=110)
                  for key in (["self_device_time_total"] if device_events else []) + ["self_cpu_time_total"]]
        # the ops again per input shape (which add or copy of which tensor): ops run eagerly only, as a CUDA
        # graph's replay is one host call whose kernels carry no op or shape
        by_shape = self._profiler.key_averages(group_by_input_shape=True)
        tables.append(by_shape.table(sort_by="self_device_time_total" if device_events else "self_cpu_time_total",
                                     row_limit=40, max_name_column_width=60, max_shapes_column_width=100))
        with open(self.profile_path, "w") as f:
            f.write(f"{steps} profiled steps; {self.summary or 'no device kernels (a CPU run)'}\n" + "\n".join(tables) + "\n")
        self._profiler = None


STEP_FUNCTIONS: dict[str, Callable[..., tuple[list[float], float, dict]]] = {
    "hf_peft": hf_peft_steps,
    "liger": lambda spec, ids, n: hf_peft_steps(spec, ids, n, liger=True),
    "unsloth": unsloth_steps,
    "lightning_ft": lightning_ft_steps,
}
