"""LoRA linear layer in three matrix products: ``y = x Wᵀ + b + s · (x Aᵀ) Bᵀ``.

PEFT's ``lora.Linear.forward`` runs the frozen base layer, then ``lora_B(lora_A(dropout(x)))``,
a multiplication by the scaling and an addition: four module calls through Python (with their
hooks and argument checks) and two elementwise kernels per layer and pass. Here:

    h = x Aᵀ                              [T, r]
    y = addmm_(x Wᵀ + b, h, Bᵀ, alpha=s)   the scaling and the sum in the last GEMM's epilogue, in place

three ops whose backward autograd runs in C++ (with an e4m3 base weight, ``x Wᵀ + b`` is
`lightning_ft.kernels.fp8.fp8_linear`: row-wise fp8 scales, no weight gradient) (a custom autograd.Function would put Python back
into every backward). Under autocast every product runs in the autocast dtype, as PEFT's do; the
scaling is applied in fp32 inside the GEMM rather than to a bf16-rounded product, so bf16 results
agree with PEFT's to bf16 rounding, not bit for bit. LoRA dropout, DoRA and other variants, a LoRA
bias and trainable base weights are not covered: `lora_linear_adapters` says for which adapters
this is the same math as PEFT's forward.

Kept projections (CUDA graphs, `lightning_ft.strategies.kept`): a forward offers (y, h) to ``keep``
(a later forward, the CUDA graphs' recording and replays, computes them straight into the kept
buffers: at 8K tokens of Qwen3-30B-A3B, 112 MiB of q/k/v/o outputs per layer not copied); the
recompute of that forward takes them back and returns y through `_KeptLoRALinear`, which runs no
product forward and differentiates as autograd does through the three ops above: the gradients of
A and B are the same products with the same roundings, in the same dtypes (tested bit for bit).
x's gradient is summed otherwise: the kept layers that read one x (q/k/v read the same normed
hidden states) hand their terms to one `_InputGradient`, which adds them in one [T, K] buffer once
all have run backward: ``dx = Σ dhᵢ Aᵢ`` (one GEMM over the concatenated ranks), then ``dx += dyᵢ Wᵢ``
for each layer inside the base GEMM (its epilogue reads dx: ``addmm_``). Autograd instead writes
each product, adds base and LoRA per layer, then adds the layers' sums: per layer one [T, K] pass
to write the LoRA product and one add, and an add per extra reader. The products are the same; the
sum rounds once per GEMM instead of once per add (fp32: ~1e-7 relative; bf16: as close to the
float64 sum as autograd's, tested). On an H200 under CUDA-graph replay (bf16, Qwen3-30B-A3B shapes)
the input gradient of q/k/v takes about a quarter less time, o's about a sixth less. An x
in another dtype than the products (an fp32 input under bf16 autocast) keeps autograd's sum, in x's
dtype. Frozen base weights only: the caller (`lightning_ft.model.patching`) keeps nothing otherwise.

Source of the method: LoRA, Hu et al. 2021 (arXiv:2106.09685); the layer layout is PEFT 0.21's
``peft.tuners.lora.layer.Linear``.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from lightning_ft.kernels.fp8 import fp8_input_grad, fp8_linear, fp8_rows_of


def lora_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Plain-torch reference: ``F.linear(x, W, b) + F.linear(F.linear(x, A), B) * s`` (PEFT's order of operations)."""
    return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_A), lora_B) * scaling


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    keep=None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A LoRA linear layer, ``x Wᵀ + b + scaling · (x Aᵀ) Bᵀ``, in three matrix products.

    Args:
        x: [..., K] input.
        weight: [N, K] frozen base weight; bias: [N] base bias or None.
        lora_A: [r, K] and lora_B: [N, r] adapter weights (PEFT keeps them in fp32; under autocast
            they are cast like any matmul operand).
        scaling: PEFT's ``lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA).
        keep: kept activations (`lightning_ft.strategies.kept.KeptActivations`, or anything with its
            ``recompute``, ``store``, ``buffers`` and ``take``), with ``weight`` and ``bias`` frozen:
            a forward offers (y, h = x Aᵀ) to ``store`` (a later forward computes them straight
            into the keep's ``buffers`` where their dtypes allow: no copy); a recompute of it on
            the same inputs takes them back and computes no product (nothing may change y in place
            afterwards: it is the kept buffer, or a view of it; no gradient for ``weight`` or
            ``bias``).
        weight_scale: [N] fp32 per-output-channel scales of an e4m3 ``weight`` (fp8 base weights,
            `lightning_ft.strategies.fp8`): the base product is `lightning_ft.kernels.fp8.fp8_linear`
            (over x's fp8 rows where the kernel that wrote x left them: `lightning_ft.kernels.fp8.fp8_rows_of`),
            and a kept output's input gradient `lightning_ft.kernels.fp8.fp8_input_grad`.

    Returns:
        [..., N] in the autocast dtype when autocast is on, else in the operands' common dtype.

    Raises:
        RuntimeError: without autocast, operands of different dtypes (torch's matmul error).
    """
    if keep is not None and keep.recompute and (kept := keep.take()) is not None:
        y, h = kept
        shared = _shared_input(x, y.dtype)
        if shared is None:
            return _KeptLoRALinear.apply(y, h, None, None, x, weight, lora_A, lora_B, scaling, weight_scale)
        token, input_grad = shared
        return _KeptLoRALinear.apply(y, h, token, input_grad, x.detach(), weight, lora_A, lora_B, scaling, weight_scale)
    buffers = keep.buffers() if keep is not None and not keep.recompute else None
    into_buffers = buffers is not None and _computable_into(buffers, x, weight, bias, lora_A)
    x2 = x.reshape(-1, x.shape[-1])
    if into_buffers:
        # a later forward (a CUDA graph's): the products land in the kept buffers, no copy after
        # (F.linear's own GEMMs, on the operands autocast would give them)
        y2, h2 = (t.view(-1, t.shape[-1]) for t in buffers)
        torch.mm(x2, weight.t(), out=y2)
        torch.mm(x2, lora_A.t().to(h2.dtype), out=h2)
    else:
        # on [T, K] rows, viewed back after the in-place add: F.linear of a 3-D x returns a view of its
        # 2-D product, and an in-place op through a view of that view, with a tensor hook on the output,
        # crashes torch 2.13's autograd (a segfault; with a bias, e.g. a user's hook on gpt-oss's q_proj)
        base = F.linear(x2, weight, bias) if weight_scale is None else fp8_linear(x2, weight, weight_scale, bias, fp8_rows_of(x))
        y2, h2 = base, F.linear(x2, lora_A)
    # in place into y (its backward needs neither y nor its old value): an out-of-place addmm first
    # copies y into a new [T, N] tensor.
    # In-place ops are not autocast: B is cast as autocast would have cast it.
    lora_B_t = lora_B.t().to(h2.dtype) if torch.is_autocast_enabled(x.device.type) else lora_B.t()
    y2.addmm_(h2, lora_B_t, alpha=scaling)
    # the buffers themselves (a later store copies nothing into them), else views of the 2-D products
    y, h = buffers if into_buffers else (t.view(*x.shape[:-1], t.shape[-1]) for t in (y2, h2))
    if keep is not None and not keep.recompute:
        keep.store((y, h))
    return y


def _computable_into(buffers: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A) -> bool:
    """Whether `lora_linear`'s two first products can be computed straight into the kept ``(y, h)``:
    no grad mode (``out=`` products are not differentiable; the CUDA graphs' forwards run without
    grad), no bias, a contiguous x (else F.linear takes another matmul path, other roundings), x and
    the base weight in the buffers' dtype (what autocast computes in, so no cast is skipped), A in
    it too or cast to it by autocast, and buffers laid out as the products' contiguous outputs."""
    y, h = buffers
    return (
        not torch.is_grad_enabled()
        and bias is None
        and x.is_contiguous()
        and x.dtype == weight.dtype == y.dtype == h.dtype
        and (lora_A.dtype == h.dtype or torch.is_autocast_enabled(x.device.type))
        and y.is_contiguous()
        and h.is_contiguous()
        and y.shape[:-1] == x.shape[:-1] == h.shape[:-1]
    )


_SHARED_ATTR = "_lightning_ft_input_gradient"  # on x: (x's version, product dtype, weakref to the token, `_InputGradient`)


def _shared_input(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, "_InputGradient"] | None:
    """The (token, `_InputGradient`) through which the kept LoRA layers reading ``x`` return its gradient.

    The first kept layer to read ``x`` makes them (`_SharedInput`); the next ones reading the same
    tensor, unchanged since and with products in the same dtype, get the same pair while the token
    lives (its readers' saved tensors hold it; ``x`` holds only a weak reference: the token's node
    leads back to ``x``, and a strong one would keep a leaf ``x`` alive). None where ``x`` needs no
    gradient (then no layer computes one) or is in another dtype than the products (autograd's sum,
    in x's dtype).
    """
    if not (torch.is_grad_enabled() and x.requires_grad) or x.dtype != dtype:
        return None
    shared = getattr(x, _SHARED_ATTR, None)
    token = shared[2]() if shared is not None and shared[0] == x._version and shared[1] == dtype else None
    if token is None:
        input_grad = _InputGradient(x.shape)
        token = _SharedInput.apply(x, input_grad)
        shared = (x._version, dtype, weakref.ref(token), input_grad)
        setattr(x, _SHARED_ATTR, shared)
    return token, shared[3]


class _InputGradient:
    """The gradient of one input x read by several kept LoRA layers, collected from their backward
    and summed once in one buffer (see the module docstring): each layer's `add` leaves its terms
    (dy [M, N], dh = s·dy·B [M, r], A [r, K], W [N, K], in the products' dtype); `total` runs once all
    the readers have run their backward (`_SharedInput`'s backward, which autograd runs after them)."""

    def __init__(self, shape: torch.Size):
        self.shape = shape
        self.terms: list[tuple[torch.Tensor, ...]] = []

    def add(
        self, dy: torch.Tensor, dh: torch.Tensor, lora_A: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None
    ) -> None:
        """One reader's terms; an e4m3 ``weight`` with its ``weight_scale`` (fp8 base) as it is, else in dy's dtype."""
        self.terms.append((dy, dh, lora_A, weight, weight_scale))

    def total(self) -> torch.Tensor | None:
        """``Σ dhᵢ Aᵢ + Σ dyᵢ Wᵢ`` as [*x.shape] in the products' dtype, or None without terms; forgets
        the terms (a second backward through a retained graph collects its own)."""
        terms, self.terms = self.terms, []
        if not terms:
            return None
        dh = torch.cat([t[1] for t in terms], dim=1) if len(terms) > 1 else terms[0][1]
        lora_A = torch.cat([t[2] for t in terms], dim=0) if len(terms) > 1 else terms[0][2]
        # fp8 bases first (``_scaled_mm`` adds into no output): their products start the sum; then the thin products
        # and the 16-bit bases add into it in their GEMMs' epilogues (addmm_), no elementwise pass of their own
        dx = None
        for dy, _, _, weight, weight_scale in terms:
            if weight_scale is not None:
                product = fp8_input_grad(dy, weight, weight_scale).to(dh.dtype)
                dx = product if dx is None else dx.add_(product)
        dx = dh @ lora_A if dx is None else dx.addmm_(dh, lora_A)
        for dy, _, _, weight, weight_scale in terms:
            if weight_scale is None:
                dx.addmm_(dy, weight)
        return dx.view(self.shape)


class _SharedInput(torch.autograd.Function):
    """x → an empty token that the kept LoRA layers reading x take instead of x (they read a detached
    x); autograd runs this backward after all of theirs (each hands the token an empty gradient), and
    it returns x's summed gradient (`_InputGradient.total`). Differentiable (``create_graph``): the
    sum's products read the readers' dy and dh, recorded by their backward."""

    @staticmethod
    def forward(ctx, x, input_grad):
        ctx.input_grad = input_grad
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        return ctx.input_grad.total(), None


class _KeptLoRALinear(torch.autograd.Function):
    """`lora_linear`'s output y, kept from the forward: returned as it is, differentiated as autograd
    differentiates the three ops (``F.linear`` twice, ``addmm_``), in y's dtype (the autocast dtype):

        dh = (dy B) * s        dx = dy W + dh A        dA = dhᵀ x        dB = (dyᵀ h) * s

    each product rounded to y's dtype, then cast to the operand's dtype (as autocast's casts do:
    PEFT keeps A and B in fp32). Saves x (cast to y's dtype), h and the weights. No gradient for the
    base weight (frozen: `lightning_ft.model.patching`); an e4m3 base (``weight_scale``) gives dy W as
    `lightning_ft.kernels.fp8.fp8_input_grad`, as `fp8_linear`'s backward does. With a ``token`` (`_shared_input`), x's
    terms go to ``input_grad`` (summed there with the other readers' of x) and the token gets an empty
    gradient; without one, dx's two paths are cast to x's dtype and summed there (as autograd sums them).
    """

    @staticmethod
    def forward(ctx, y, h, token, input_grad, x, weight, lora_A, lora_B, scaling, weight_scale):
        ctx.scaling = scaling
        ctx.x_dtype = x.dtype
        ctx.input_grad = input_grad
        ctx.save_for_backward(h, x.to(y.dtype), weight, lora_A, lora_B, token, weight_scale)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        h, x, weight, lora_A, lora_B, token, weight_scale = ctx.saved_tensors
        needs_token, _, needs_x, _, needs_a, needs_b = ctx.needs_input_grad[2:8]
        dtype = dy.dtype
        dy2, h2, x2 = dy.reshape(-1, dy.shape[-1]), h.reshape(-1, h.shape[-1]), x.reshape(-1, x.shape[-1])
        # x's terms only where this backward pass runs the token's node (one asking for x's gradient):
        # terms left by a pass that does not (e.g. autograd.grad for A alone) would be summed by the next
        to_sum = needs_token and torch._C._will_engine_execute_node(token.grad_fn)
        dtoken = dx = da = db = None
        if needs_x or needs_a or to_sum:
            dh = (dy2 @ lora_B.to(dtype)) * ctx.scaling
            if needs_a:
                da = (dh.t() @ x2).to(lora_A.dtype)
            if to_sum:
                base_weight = weight if weight_scale is not None else weight.to(dtype)  # e4m3 as it is
                ctx.input_grad.add(dy2, dh, lora_A.to(dtype), base_weight, weight_scale)
                dtoken = torch.empty_like(token)
            if needs_x:  # each path cast back to x's dtype, then summed there (as autograd sums the two)
                base = dy2 @ weight.to(dtype) if weight_scale is None else fp8_input_grad(dy2, weight, weight_scale).to(dtype)
                if weight_scale is not None and ctx.x_dtype == dtype:  # the thin product added in its GEMM's epilogue
                    dx = base.addmm_(dh, lora_A.to(dtype))
                else:
                    dx = base.to(ctx.x_dtype) + (dh @ lora_A.to(dtype)).to(ctx.x_dtype)
                dx = dx.view(*dy.shape[:-1], -1)
        if needs_b:
            db = ((dy2.t() @ h2) * ctx.scaling).to(lora_B.dtype)  # as addmm's backward for a transposed mat2
        return None, None, dtoken, None, dx, None, da, db, None, None


