"""DDP (``strategy=ddp``): Lightning's `DDPStrategy` with the gradient hooks on the training stream.

Lightning builds `DistributedDataParallel` under a fresh CUDA side stream. DDP creates its
gradient-accumulation hooks (one ``AccumulateGrad`` node per trainable tensor) at construction, so
on torch 2.11 every one of them belongs to that side stream while backward runs on the default
stream: autograd then synchronises the two streams for each gradient (torch warns: "The
AccumulateGrad node's stream does not match the stream of the node that produced the incoming
gradient"). Measured on 2 H200s, Llama-3.1-8B shape, LoRA on all linear layers (448 tensors), 4K
tokens per GPU and step: backward took 347 ms per step under Lightning's DDP against 277 ms on one
GPU (Lightning's SimpleProfiler); built on the current stream, the 2-GPU run keeps 94% of one
GPU's tokens/s per GPU instead of 82%, with the same losses (benchmarks/RESULTS.md, "Session 3").

Also ``gradient_as_bucket_view=True``: gradients live in DDP's all-reduce buckets, with no copy
into the buckets after every backward.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import StrategyRegistry
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

STRATEGY_NAME = "lightning_ft_ddp"


class DDPStrategy(LightningDDPStrategy):
    """Lightning's `DDPStrategy`, with `DistributedDataParallel` built on the current stream.

    Args:
        kwargs: `DDPStrategy` arguments; `DistributedDataParallel` keyword arguments among them
            override the default ``gradient_as_bucket_view=True``.
    """

    def __init__(self, **kwargs: Any):
        kwargs = {"gradient_as_bucket_view": True, **kwargs}
        super().__init__(**kwargs)

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)


StrategyRegistry.register(
    STRATEGY_NAME, DDPStrategy, description="DDP with its gradient hooks on the training stream, lightning_ft"
)
