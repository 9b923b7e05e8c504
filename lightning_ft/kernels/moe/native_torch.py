"""The ``native_torch`` MoE experts backend: a Python loop over the experts, the plain-torch reference.

* ``native_torch``: a Python loop over experts slicing the sorted rows by ``offsets_E``. It reads
  the offsets back to the host once per call (one device-to-host sync per MoE layer forward, none in
  backward); it is the plain-torch reference of this math and the fallback on any device.

Math, shapes and split LoRA: `lightning_ft.kernels.moe._common`.
"""

from __future__ import annotations

import torch

from lightning_ft.kernels.moe._common import ExpertBiases, _LoRAFactors, _refuse_host_sync_in_capture, _swiglu

__all__: list[str] = []


def _linear_native(x: torch.Tensor, w_NC: torch.Tensor, lora: _LoRAFactors | None, expert: int) -> torch.Tensor:
    y = x @ w_NC.T
    if lora is not None:
        a_ERC, b_ENR, scaling = lora
        y = y + scaling * ((x @ a_ERC[expert].T) @ b_ENR[expert].T)
    return y


def experts_native_torch(
    x_SD, routing, weight_S, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down, biases=ExpertBiases()
):  # fmt: skip
    """y_SD of the native_torch backend: each expert's rows of the expert-sorted x_SD [S, D] through
    down(act(gate) * up) (+ split LoRA, + ``biases``), scaled by the routing weight_S [S]. Math:
    `lightning_ft.kernels.moe._common`.

    One host sync per call (the offsets read back); the backward has none.

    Raises:
        RuntimeError: called while a CUDA graph is being captured (the sync would break it).
    """
    _refuse_host_sync_in_capture(x_SD, "the native_torch expert loop reads the offsets back to the host")
    ends = routing.offsets_E.tolist()
    outputs, start = [], 0
    for expert, end in enumerate(ends):
        if end > start:
            h = _linear_native(x_SD[start:end], w_gate_up_EFD[expert], lora_gate_up, expert)
            if biases.gate_up_EF is not None:
                h = h + biases.gate_up_EF[expert]
            a = _swiglu(h, act_fn, weight_S[start:end])
            y = _linear_native(a, w_down_EDI[expert], lora_down, expert)
            if biases.down_ED is not None:  # a holds the routing weight: so does the bias term
                y = y + weight_S[start:end, None] * biases.down_ED[expert]
            outputs.append(y)
        start = end
    if not outputs:  # no rows at all: an empty output still attached to the graph (weight_S is [0])
        return x_SD.new_zeros(0, w_down_EDI.shape[1]) + weight_S[:, None]
    return torch.cat(outputs)
