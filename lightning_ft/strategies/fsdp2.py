"""FSDP2 (``strategy=fsdp2``): the frozen base and the trainable adapters sharded over the data-parallel ranks.

Lightning owns the processes, the device mesh, the loop and the checkpoints (`FSDP2Strategy` is
its `ModelParallelStrategy` with data parallelism only); `FinetuneModule.configure_model` builds
and patches the model as on one device and then calls `shard_model`, which applies PyTorch's
``fully_shard`` (torch >= 2.6)::

    FinetuneModule                 root unit: what no layer owns (embeddings, final norm, lm_head)
      model (PEFT) ─ HF model
        layers[0] … layers[L-1]    one unit each: attention, MLP or experts, their LoRA weights

Every parameter (frozen base weight or trainable LoRA weight) is a ``DTensor`` sharded on dim 0
over the ranks. A unit's weights are all-gathered just before it runs and freed after it (the
decoder layers after their forward, again after their backward; the root unit after backward),
and the trainable weights' gradients are reduce-scattered, averaged over the ranks, as DDP's
all-reduce would. Frozen and trainable weights may share a unit: FSDP2 tracks ``requires_grad``
per parameter and reduces only the gradients that exist; it needs one dtype among a unit's
trainable weights (checked in `shard_model`).

Note (the loss reads ``lm_head.weight`` directly): the fused linear cross-entropy takes the head's
weight, never calling the head. FSDP2 gathers weights in the pre-forward hook of a unit's
``forward``; `shard_model` therefore makes the LightningModule the root unit and registers
`FinetuneModule.loss_terms` (which `FinetuneModule.loss_sum` calls) as its forward method
(``register_fsdp_forward_method``): the root's weights, the head among them, are whole tensors
for the duration of ``loss_terms`` and until its
backward has run (the root is not resharded after forward), and a trainable head's gradient is
reduce-scattered by the root's post-backward like any other. The non-fused path (``head(hidden)``)
runs in the same window. Tied embeddings stay one weight, since both live in the root unit.

Mixed precision (``precision=bf16``: Lightning ``bf16-mixed``): ``MixedPrecisionPolicy`` gathers
the weights in bf16 and reduce-scatters gradients in fp32; the sharded weights (bf16 frozen base,
fp32 LoRA) keep their dtypes and the optimizer steps on them. Inputs are not cast
(``cast_forward_inputs=False``): a `PackedBatch` passed down to the layers must stay the one
object whose attention structures are built once per batch and cached on it.

Gradient checkpointing composes: transformers wraps each decoder layer's call in
``torch.utils.checkpoint`` (non-reentrant) before sharding; the recomputation in backward runs
the layer's FSDP pre-forward again, which finds the weights already gathered by the pre-backward
hook.

Checkpoints: the trainable weights and their optimizer states are gathered to full tensors on
rank 0 (the frozen weights are not gathered at all) and written as one ``.ckpt`` file through the
trainer's checkpoint IO (`AtomicCheckpointIO`), in the layout one device and DDP write (the
optimizer state numbered as ``Optimizer.state_dict()`` numbers it), so a run may resume under
another of these strategies. A resume reads the file on every rank and each keeps its own slices.
The adapter export gathers like the checkpoint (`gather_state_dict`).

Lockstep: every forward all-gathers weights, so every rank must run the same number of forward
passes (training steps are equal by construction; validation pads ranks with a masked row in
`PackedDataModule`). Greedy generation (``eval.generate``) stops at a different token on every
rank and is refused with this strategy.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy, StrategyRegistry
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ft.strategies.strategy import ExecutionMixin

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

STRATEGY_NAME = "fsdp2"
_LOSS_METHOD = "loss_terms"  # the FinetuneModule method that reads the root unit's weights


class FSDP2Strategy(ExecutionMixin, ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` as pure data parallelism: FSDP2 over every device of every node.

    ``trainer.devices`` (times ``trainer.num_nodes``) ranks form the ``data_parallel`` mesh
    dimension; ``tensor_parallel`` has size 1. The model is built on each rank's device (as under
    DDP: the whole model fits one device until `shard_model` shards it), and checkpoints are
    single files holding the full trainable weights (see the module docstring).

    Args:
        kwargs: ``execution`` (`lightning_ft.strategies.strategy.ExecutionMixin`: CUDA graphs are skipped
            here) and other `ModelParallelStrategy` arguments (``process_group_backend``, ``timeout``).
    """

    def __init__(self, **kwargs: Any):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False, **kwargs)

    @override
    def setup_environment(self) -> None:
        # Lightning's "auto" is one data-parallel group per node; here every rank is data-parallel
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # ModelParallelStrategy builds on the CPU; build on the rank's device as the other strategies do
        with Strategy.tensor_init_context(self, empty_init):
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full trainable weights on rank 0 (empty on the other ranks); a collective.

        Lightning's own gathers every weight, the frozen base too, before our ``on_save_checkpoint``
        keeps only the trainable ones.
        """
        return gather_state_dict(self.model, trainable_only=True)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state on rank 0 (empty on the other ranks), in ``Optimizer.state_dict()``'s own
        layout (parameters numbered in the optimizer's order), as one device and DDP write it; a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(self.model, optimizer, options=options)
        if not state:
            return state
        position = {name: i for i, name in enumerate(self._parameter_names(optimizer))}
        return {
            "state": {position[name]: value for name, value in state["state"].items()},
            "param_groups": [{**g, "params": [position[name] for name in g["params"]]} for g in state["param_groups"]],
        }

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a single-file checkpoint (written by this strategy, one device or DDP) into the shards.

        Every rank reads the file (it holds the trainable weights only) and keeps its own slices.
        Lightning's own loader numbers the optimizer's parameters among all the model's parameters,
        frozen ones included, so it would misread the state of an optimizer that holds only the
        trainable ones.

        Raises:
            ValueError: ``checkpoint_path`` is not a file (a sharded checkpoint folder is not supported).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file():
            raise ValueError(f"ckpt_path={path}: not a checkpoint file (strategy=fsdp2 writes and reads single .ckpt files)")
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        full = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, checkpoint["state_dict"], options=full)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            names = self._parameter_names(optimizer)
            state = {
                "state": {names[i]: value for i, value in state["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
            }
            set_optimizer_state_dict(self.model, optimizer, state, options=full)
        return checkpoint

    def _parameter_names(self, optimizer: Optimizer) -> list[str]:
        """The names (in ``self.model``) of ``optimizer``'s parameters, in the optimizer's order."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


StrategyRegistry.register(
    STRATEGY_NAME, FSDP2Strategy, description="FSDP2 (fully_shard per decoder layer) over all devices, lightning_ft"
)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are FSDP2 shards (``DTensor``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor``; any other tensor as it is (no communication)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a ``DTensor`` (a collective: every rank must call it); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for a Lightning ``trainer.precision`` value.

    ``bf16-mixed``: weights gathered in bf16 for the math, gradients reduce-scattered in fp32.
    Anything else (``32-true``): no casting. Forward inputs are never cast (module docstring).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if str(precision) == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model (its ``_no_split_modules`` classes), PEFT-wrapped or not.

    Raises:
        ValueError: the model names no such classes, or none of its modules is one.
    """
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(hf, "_no_split_modules", None) or ())
    layers = [m for m in hf.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"strategy=fsdp2: cannot find the decoder layers of {type(hf).__name__} (transformers' _no_split_modules "
            f"is {sorted(names) or 'empty'}), so there is nothing to shard per layer; use strategy=ddp"
        )
    return layers


def shard_model(root: torch.nn.Module, model: torch.nn.Module, mesh: DeviceMesh, precision: str) -> None:
    """Shard ``root`` (the LightningModule holding ``model``) with FSDP2: one unit per decoder layer, then the root.

    Before sharding, rank 0's weights are broadcast to the other ranks (as DDP does), so a random
    init and PEFT's random ``lora_A`` start the same everywhere. Afterwards ``root.loss_terms`` runs
    as the root unit's forward (module docstring).

    Args:
        root: the module whose ``loss_terms`` computes the loss from ``model``'s weights.
        model: the (PEFT-wrapped) transformers model inside ``root``.
        mesh: ``ModelParallelStrategy.device_mesh``: FSDP2 shards over its ``data_parallel``
            dimension; its ``tensor_parallel`` dimension must have size 1.
        precision: ``trainer.precision`` (see `mixed_precision_policy`).

    Raises:
        ValueError: tensor parallelism was asked for, the decoder layers cannot be found, or a unit's
            trainable weights have more than one dtype (FSDP2 reduces one gradient dtype per unit).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if mesh["tensor_parallel"].size() != 1:
        raise ValueError(
            f"tensor_parallel_size={mesh['tensor_parallel'].size()}: lightning_ft shards with FSDP2 only; "
            "use strategy=fsdp2 (data parallel over every device)"
        )
    dp_mesh = mesh["data_parallel"]
    layers = decoder_layers(model)
    _check_trainable_dtypes(root, layers)
    if dp_mesh.size() > 1:
        group = dp_mesh.get_group()
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for tensor in [*root.parameters(), *root.buffers()]:
                dist.broadcast(tensor, src=src, group=group)
    policy = mixed_precision_policy(precision)
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    fully_shard(root, mesh=dp_mesh, mp_policy=policy)
    register_fsdp_forward_method(root, _LOSS_METHOD)


def _check_trainable_dtypes(root: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    # the lists of weights live only in here: each layer's whole weights must be freed as soon as
    # that layer is sharded, so nothing may hold them while shard_model runs
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    units = [(f"decoder layer {i}", list(layer.named_parameters())) for i, layer in enumerate(layers)]
    units.append(("the root unit", [(n, p) for n, p in root.named_parameters() if id(p) not in in_layers]))
    for unit, params in units:
        dtypes: dict[torch.dtype, str] = {}
        for name, p in params:
            if p.requires_grad:
                dtypes.setdefault(p.dtype, name)
        if len(dtypes) > 1:
            shown = ", ".join(f"{name} is {str(dtype).removeprefix('torch.')}" for dtype, name in dtypes.items())
            raise ValueError(
                f"strategy=fsdp2: the trainable weights of {unit} have more than one dtype ({shown}); FSDP2 needs one. "
                "PEFT keeps LoRA weights in fp32 and its modules_to_save copies in the model's dtype: train no whole "
                "module beside them (moe.train_router=false, lora.modules_to_save=null), or use model.dtype=float32, "
                "or strategy=ddp"
            )


def gather_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor] | None:
    """``model``'s state dict as full CPU tensors on rank 0, for a checkpoint or an export; a collective when sharded.

    Returns None when ``model`` is not sharded (the caller uses ``model.state_dict()`` as usual),
    and an empty dict on the ranks other than 0.

    Args:
        model: a module inside an FSDP2-sharded tree (keys are relative to it).
        trainable_only: only the trainable weights, one at a time (the frozen ones are never
            gathered; an LM head tied to the embeddings neither, which a state dict lists twice).
    """
    if not is_sharded(model):
        return None
    import torch.distributed as dist

    if trainable_only:
        keep = dist.get_rank() == 0
        gathered = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                full = full_tensor(p.detach())
                if keep:
                    gathered[name] = full.cpu()
        return gathered
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
