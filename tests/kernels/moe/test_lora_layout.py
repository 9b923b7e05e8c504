"""PEFT's interleaved expert LoRA B [N, R*E] to [E, N, R]: the Triton pass against the plain-torch copy, both ways.

A layout change and one rounding, so forward and backward must match the reference exactly; except
that Triton's CPU interpreter truncates fp32 to bf16 where the GPU (and torch) round to nearest even:
there a narrowing cast may differ by one bf16 ulp (relative 2**-7).
"""

import pytest
import torch

from lightning_ft.kernels.moe.lora_layout import expert_major_lora_b, expert_major_lora_b_reference


@pytest.mark.parametrize(
    "n_size,rank,num_experts",
    [
        (37, 3, 5),  # nothing a power of two
        (33, 17, 70),  # several blocks along R and E (blocks of 16 and 64), a ragged last one each
        (2048, 16, 128),  # Qwen3-30B-A3B's down projection
    ],
)
@pytest.mark.parametrize(
    "param_dtype,dtype",
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
def test_matches_the_reference_forward_and_backward(device, n_size, rank, num_experts, param_dtype, dtype):
    if device.type == "cpu" and n_size * rank * num_experts > 100_000:
        pytest.skip("the model-sized case runs on the GPU only (minutes under the interpreter)")
    torch.manual_seed(0)
    lora_b = torch.randn(n_size, rank * num_experts, device=device, dtype=param_dtype, requires_grad=True)
    # a gradient that is not contiguous in the [E, N, R] layout: the backward reads it through its strides
    grad = torch.randn(n_size, rank, num_experts, device=device, dtype=dtype).permute(2, 0, 1)

    out = expert_major_lora_b(lora_b, num_experts, dtype)
    (grad_fast,) = torch.autograd.grad(out, lora_b, grad)
    ref = expert_major_lora_b_reference(lora_b, num_experts, dtype)
    (grad_ref,) = torch.autograd.grad(ref, lora_b, grad)

    truncates = device.type == "cpu" and dtype == torch.bfloat16 and param_dtype == torch.float32
    tolerance = {"rtol": 2**-7, "atol": 0} if truncates else {"rtol": 0, "atol": 0}
    assert out.shape == (num_experts, n_size, rank) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref, **tolerance)
    assert grad_fast.dtype == param_dtype and grad_fast.shape == lora_b.shape
    torch.testing.assert_close(grad_fast, grad_ref, rtol=0, atol=0)  # bf16 -> fp32 widens: always exact
    # and the layout itself, element by element: b_ENR[e, n, j] = lora_B[n, j*E + e]
    e, n, j = num_experts - 1, n_size // 2, rank - 1
    torch.testing.assert_close(out[e, n, j], lora_b[n, j * num_experts + e].to(dtype), **tolerance)


def test_a_strided_lora_b_is_read_through_its_strides(device):
    torch.manual_seed(0)
    base = torch.randn(12, 2 * 3 * 4, device=device)
    lora_b = base[:, ::2]  # [12, 12], column stride 2
    torch.testing.assert_close(
        expert_major_lora_b(lora_b, 4, torch.float32), expert_major_lora_b_reference(lora_b, 4, torch.float32),
        rtol=0, atol=0,
    )


def test_refuses_a_width_that_is_not_rank_times_experts():
    with pytest.raises(ValueError, match=r"lora_B \(8, 10\) is not \[N, R\*E\] for E=4 experts"):
        expert_major_lora_b(torch.zeros(8, 10), 4, torch.float32)
