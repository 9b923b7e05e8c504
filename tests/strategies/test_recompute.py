"""The passes of a checkpointed layer (`lightning_ft.strategies.recompute`): marked in torch.utils.checkpoint's forward
and recompute, re-enterable, nested, per thread."""

import functools
import threading

import torch
from torch.utils.checkpoint import checkpoint

from lightning_ft.strategies.recompute import (
    checkpoint_contexts, checkpoint_pass, checkpointed_layer, recomputing, recomputing_for_backward,
)


def test_torch_checkpoint_marks_its_forward_and_each_recompute_of_the_layer():
    layer = torch.nn.Linear(3, 3)
    seen = []

    def run(x):
        seen.append((checkpoint_pass(), checkpointed_layer() is layer, recomputing_for_backward()))
        return layer(x).tanh()

    x = torch.randn(2, 3, requires_grad=True)
    out = checkpoint(run, x, use_reentrant=False, context_fn=functools.partial(checkpoint_contexts, layer)).sum()
    out.backward(retain_graph=True)
    out.backward()  # a second recompute through the retained graph enters the recompute context again
    assert seen == [("forward", True, False), ("recompute", True, False), ("recompute", True, False)]
    assert checkpoint_pass() is None and checkpointed_layer() is None


def test_passes_nest_and_restore_and_belong_to_their_thread():
    forward, recompute = checkpoint_contexts()
    with forward:
        with recomputing():
            assert recomputing_for_backward() and checkpoint_pass() is None
            other = []
            thread = threading.Thread(target=lambda: other.append((checkpoint_pass(), recomputing_for_backward())))
            thread.start()
            thread.join()
            assert other == [(None, False)]
        assert checkpoint_pass() == "forward" and checkpointed_layer() is None
        with recompute:
            assert checkpoint_pass() == "recompute"
        with recompute:  # the same context again
            assert checkpoint_pass() == "recompute"
        assert checkpoint_pass() == "forward"
    assert checkpoint_pass() is None and not recomputing_for_backward()
