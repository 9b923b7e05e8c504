"""The memory plan: for each decoder layer and each class of saved tensor, keep it, offload it or recompute it.

(Filled in below.)
"""

from __future__ import annotations

from typing import Any

GIB = 2**30
#: ``memory_budget_gib=auto``: the free GPU memory less this share of it, for the allocator's
#: fragmentation and the kernels' workspaces that the plan does not see
AUTO_MARGIN = 0.10


def budget_bytes(memory_budget_gib: Any, free_bytes: int, margin: float = AUTO_MARGIN) -> int | None:
    """``strategy.memory_budget_gib`` in bytes.

    Args:
        memory_budget_gib: a number of GiB > 0, ``auto`` (``free_bytes`` less ``margin`` of it) or None (no plan).
        free_bytes: the device's free memory (``torch.cuda.mem_get_info``), for ``auto``.
        margin: the share of ``free_bytes`` that ``auto`` leaves alone.

    Raises:
        ValueError: anything else, naming the key.
    """
    if memory_budget_gib is None:
        return None
    if memory_budget_gib == "auto":
        return int(free_bytes * (1 - margin))
    if isinstance(memory_budget_gib, bool) or not isinstance(memory_budget_gib, (int, float)) or not memory_budget_gib > 0:
        raise ValueError(f"strategy.memory_budget_gib={memory_budget_gib!r}: expected a number of GiB > 0, auto, or null for no plan")
    return int(memory_budget_gib * GIB)
