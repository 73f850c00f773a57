"""The torch reference of SPEC §1-§3: fp32 math, the unfused path's rounding.

It is the CPU implementation behind the public API and the oracle of the GPU
tests. Cache writes go through the contract's own index expressions (evaluated on
index tensors), so a new layout in variants.yaml is covered here as well.
"""
from __future__ import annotations

from dataclasses import make_dataclass
from typing import Optional

import torch

from kvforge.codegen.lanes import lane_map_of
from kvforge.codegen.layout import CacheAccess, access
from kvforge.codegen.model import Fp8, IndexMode, KvScale, Norm, QFp8, Rope, Saturation, Variant
from kvforge.codegen.signature import KERNEL_ARGS

FP8_DTYPES = {Fp8.E4M3FN: torch.float8_e4m3fn, Fp8.E4M3FNUZ: torch.float8_e4m3fnuz}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def to_fp8(v: torch.Tensor, fmt: Fp8, saturate: bool) -> torch.Tensor:
    """fp32 → FP8 (round to nearest even). Saturating, values are clamped to ±max first;
    without saturation a value that rounds past the max becomes NaN (signed on e4m3fn), on
    every torch version (torch itself saturates e4m3fn since 2.x but not e4m3fnuz). A NaN
    input becomes the format's positive NaN code either way, as the kernels give it
    (torch's own cast keeps the sign on some backends)."""
    dtype = FP8_DTYPES[fmt]
    out = v.clamp(-fmt.max, fmt.max).to(dtype).view(torch.uint8)
    nan = torch.full_like(out, 0x7F if fmt is Fp8.E4M3FN else 0x80)
    if saturate:
        return torch.where(v.isnan(), nan, out).view(dtype)
    mag = v.abs()
    if fmt is Fp8.E4M3FN:
        nan = torch.where(v < 0, 0xFF, 0x7F).to(torch.uint8)
        overflow = (mag > 464) | v.isnan()
    else:
        overflow = (mag >= 248) | v.isnan()
    return torch.where(overflow, nan, out).view(dtype)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add, as the kernel's fmaf: the product is exact in fp64 and
    the sum is rounded once more to fp32 (a double rounding that can differ from a true
    fma only when the fp64 sum is inexact and lands on an fp32 tie: never for the
    same-sign sums of squares, about 2^-29 of RoPE's)."""
    return (a.double() * b.double() + c.double()).float()


def div(a, b) -> torch.Tensor:
    """a / b of fp32 values (tensors or numbers), correctly rounded to fp32 as the kernel's
    IEEE division is, on every device: computed in fp64, whose quotient rounds to the same
    fp32, and never as a division by a scalar, which torch does as a product with the
    reciprocal (a 0-D divisor on the GPU)."""
    device = next(x.device for x in (a, b) if isinstance(x, torch.Tensor))
    a, b = (torch.as_tensor(x, device=device).double() for x in (a, b))
    a, b = torch.broadcast_tensors(a, b)
    return (a / b.contiguous()).float()


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root, correctly rounded (the kernel's sqrtf): torch's fp32 sqrt on an
    AVX-512 CPU is not (1 ulp off at 4.4501243); fp64's, rounded to fp32, is."""
    return torch.sqrt(x.double()).float()


def sum_of_squares(v: Variant, x: torch.Tensor) -> torch.Tensor:
    """Σ x² over the last dim in the kernel's fp32 order: each lane's dims in sequence
    (codegen/lanes.py: LaneMap.dims, one fma each), then the lanes pairwise by halving
    (the butterfly). Matching it bit for bit matters: rotations that cancel would
    otherwise magnify an order-dependent last bit past one ulp of the output."""
    order = lane_map_of(v).dims
    sq = x[..., torch.tensor(order, device=x.device)]  # [..., lanes, dims of a lane]
    s = torch.zeros_like(sq[..., 0])
    for j in range(sq.shape[-1]):
        s = fma(sq[..., j], sq[..., j], s)
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    return s  # [..., 1]


def rms_norm(v: Variant, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm over the last dim in fp32; Gemma scales by (1 + w). The variant's
    lane map fixes the summation order (`sum_of_squares`)."""
    mean = sum_of_squares(v, x) / x.shape[-1]
    inv = div(1.0, sqrt(mean + torch.tensor(eps, dtype=torch.float32)))
    wf = w.float()
    return (x * inv) * (1.0 + wf if v.norm is Norm.GEMMA else wf)


def rope(v: Variant, n: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Partial rotation of n [T, H, D] at positions [T] in the variant's style (SPEC §1):
    NeoX pairs (i, i + R/2), GPT-J pairs (2i, 2i + 1); dims ≥ R pass. Each output is one
    fma of its first product, as the kernel computes it."""
    r = v.rotary_dim
    half = r // 2
    cs = cos_sin[positions].float()
    c, s = cs[:, None, :half], cs[:, None, half:r]
    if v.rope is Rope.GPTJ:
        a, b = n[..., 0:r:2], n[..., 1:r:2]
        rotated = torch.stack([fma(a, c, -(b * s)), fma(b, c, a * s)], dim=-1).flatten(-2)
    else:
        a, b = n[..., :half], n[..., half:r]
        rotated = torch.cat([fma(a, c, -(b * s)), fma(b, c, a * s)], dim=-1)
    return torch.cat([rotated, n[..., r:]], dim=-1)


# The op's arguments the kernel reads (those with a field of kvf_args_t) after validation, by
# name: None where the call does not use one (codegen/signature.py).
Tensors = make_dataclass("Tensors", [(a.name, a.annotation(torch.Tensor)) for a in KERNEL_ARGS], frozen=True)


def write_slots(acc: CacheAccess, cache: torch.Tensor, slots: torch.Tensor,
                values: torch.Tensor) -> None:
    """Write values [N, H, D] (cache dtype) at valid slots [N] through the contract's
    offsets. No data-dependent shapes, so it also serves CUDA graphs and torch.compile."""
    page = (slots // acc.page_size).view(-1, 1, 1)
    off = (slots % acc.page_size).view(-1, 1, 1)
    h = torch.arange(values.shape[1], device=slots.device).view(1, -1, 1)
    d = torch.arange(values.shape[2], device=slots.device).view(1, 1, -1)
    offsets = torch.as_tensor(acc.offset_torch(page, off, h, d, cache.stride()), device=slots.device)
    bits = _BITS[cache.element_size()]
    if cache.is_contiguous():  # a plain view: torch.compile can functionalize the write
        flat = cache.view(bits).view(-1)
    else:                      # free strides: the elements of the view's span
        span = sum((s - 1) * st for s, st in zip(cache.shape, cache.stride())) + 1
        flat = cache.view(bits).as_strided((span,), (1,))
    flat[offsets.expand(values.shape).reshape(-1)] = values.reshape(-1).view(bits)


def _scatter(v: Variant, role: str, cache: torch.Tensor, slots: torch.Tensor,
             values: torch.Tensor) -> None:
    """write_slots for the tokens whose slot is valid (padding and out-of-range skipped)."""
    acc = access(v, role)
    keep = (slots >= 0) & (slots < acc.capacity(cache.shape))
    if bool(keep.any()):
        write_slots(acc, cache, slots[keep], values[keep])


def token_scales(v: Variant, x: torch.Tensor) -> torch.Tensor:
    """Per-token scales (per_token_head) of the fp32 values x [T, H, D] ([T, H, 1]): AITER's
    fused_qknorm_idxrqknorm definition, amax over the head / the FP8 max, 1 for an all-zero
    head (the values are then divided by it)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, div(amax, v.fp8.max),
                       torch.ones((), dtype=torch.float32))


def _quant_kv(v: Variant, x: torch.Tensor, scale: Optional[torch.Tensor], cache_dtype) -> torch.Tensor:
    """x [T, nkv, D] as the KV cache stores it; `scale`: the call's (None: unit) or, per
    token, token_scales' (which x is divided by)."""
    sat = v.contract.saturation is Saturation.SATURATE
    if v.kv_scale is KvScale.NONE:
        return x.to(cache_dtype)
    if v.kv_scale.dynamic:
        return to_fp8(div(x, scale), v.fp8, sat)
    inv = torch.ones((), device=x.device)
    if scale is not None:
        inv = div(1.0, scale).view(1, -1, 1)  # [1] or [nkv] broadcasts over heads
    return to_fp8(x * inv, v.fp8, sat)


def run(v: Variant, t: Tensors) -> None:
    """Compute everything the fused op writes, in place into t's outputs and caches."""
    D, nkv = v.head_dim, v.num_kv_heads
    nq, niq = t.num_heads, t.num_index_heads
    T = t.qkv.shape[0]
    model = t.qkv.dtype
    x = t.qkv.float().view(T, -1, D)
    pos = t.positions.long()
    valid_pos = (pos >= 0) & (pos < t.cos_sin_cache.shape[0])
    pos_c = torch.where(valid_pos, pos, torch.zeros_like(pos))
    rbq = v.contract.round_before_quant

    def normed(heads: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rope(v, rms_norm(v, heads, w, t.eps), t.cos_sin_cache, pos_c)

    # SPEC §1: a token whose position has no cos/sin row writes zeros to its q_out and
    # index_q_out rows and nothing to any cache (K, V and index alike).
    def zero_invalid(y: torch.Tensor) -> torch.Tensor:
        return torch.where(valid_pos.view(-1, 1, 1), y, torch.zeros((), dtype=y.dtype))

    q = zero_invalid(normed(x[:, :nq], t.q_norm_weight)).to(model)
    if t.q_out is not None:
        t.q_out.view(T, nq, D).copy_(q)
    if v.q_fp8 is not QFp8.NONE:  # from the rounded q, saturating (SPEC §1)
        t.q_fp8_out.view(T, nq, D).copy_(to_fp8(q.float() * div(1.0, t.q_fp8_scale).view(()), v.fp8, True))
    k = normed(x[:, nq:nq + nkv], t.k_norm_weight)
    if t.k_out is not None:
        t.k_out.view(T, nkv, D).copy_(zero_invalid(k).to(model))
    k_src = k.to(model).float() if rbq else k
    vv = x[:, nq + nkv:nq + 2 * nkv]
    n_slots = t.slot_mapping.numel()
    slots = t.slot_mapping.long()
    kv_slots = torch.where(valid_pos[:n_slots], slots, torch.full_like(slots, -1))
    k_scale, v_scale = t.k_scale, t.v_scale
    if v.kv_scale.dynamic:  # from the fp32 K (AITER's amax), K quantized from k_src all the same
        k_scale, v_scale = token_scales(v, k[:n_slots]), token_scales(v, vv[:n_slots])
        _scatter(v, "k_scale", t.k_scale_cache, kv_slots, k_scale)
        _scatter(v, "v_scale", t.v_scale_cache, kv_slots, v_scale)
    k_vals = _quant_kv(v, k_src[:n_slots], k_scale, t.k_cache.dtype)
    v_vals = _quant_kv(v, vv[:n_slots], v_scale, t.v_cache.dtype)
    _scatter(v, "k", t.k_cache, kv_slots, k_vals)
    _scatter(v, "v", t.v_cache, kv_slots, v_vals)
    if v.index_mode is not IndexMode.FULL:
        return
    base = nq + 2 * nkv
    iq = normed(x[:, base:base + niq], t.index_q_norm_weight)
    ik = normed(x[:, base + niq:base + niq + 1], t.index_k_norm_weight)
    if t.index_k_out is not None:
        t.index_k_out.view(T, 1, D).copy_(zero_invalid(ik).to(model))
    iq = zero_invalid(iq)
    if v.index_fp8:
        iq_out = to_fp8(iq, v.fp8, saturate=True)
        ik_src = ik.to(model).float() if rbq else ik
        ik_vals = to_fp8(ik_src, v.fp8, saturate=True)
    else:
        iq_out = iq.to(model)
        ik_vals = ik.to(model)
    t.index_q_out.view(T, niq, D).copy_(iq_out)
    n_islots = t.index_slot_mapping.numel()
    islots = t.index_slot_mapping.long()
    islots = torch.where(valid_pos[:n_islots], islots, torch.full_like(islots, -1))
    _scatter(v, "index", t.index_cache, islots, ik_vals[:n_islots])
