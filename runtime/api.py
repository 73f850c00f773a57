"""The Python API engines call: `fused_qknorm_rope_cache`.

Argument names follow the engines' ops (SPEC §9). Cache dtypes, scale granularity
and the FP8 flavour are read from the tensors. CUDA/ROCm tensors run the generated
kernel for the derived signature; CPU tensors run the torch reference.

The op is registered as `torch.ops.kvforge.fused_qknorm_rope_cache` (with a fake
implementation) so `torch.compile(fullgraph=True)` traces through it. Eager calls
skip the dispatcher and launch directly on torch's current stream, which is also
what CUDA-graph capture records.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import reference
from .abi import Args
from .registry import REGISTRY
from .validate import check, check_ranges

Tensor = torch.Tensor


class _Plan:
    """What one variant's launch needs besides the tensors, looked up once."""

    def __init__(self, variant) -> None:
        from codegen.layout import access

        self.lib = REGISTRY.get(variant)
        self.pages = {role: (access(variant, role).runtime_dim, access(variant, role).page_size)
                      for role in ("k", "v", "index")}


_PLANS: dict = {}


def _current_stream(device: torch.device) -> int:
    # The raw handle without building a torch Stream object (a few µs per call).
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None
                                               else torch.cuda.current_device())


def _cache_arg(dst, cache: Optional[Tensor], dims: tuple[int, int]) -> None:
    if cache is None:
        return
    dst.data = cache.data_ptr()
    dst.capacity = cache.shape[dims[0]] * dims[1]
    for i, s in enumerate(cache.stride()):
        dst.strides[i] = s


def _launch(variant, t: reference.Tensors) -> None:
    T = t.qkv.shape[0]
    if T == 0:
        return
    plan = _PLANS.get(variant)
    if plan is None:
        plan = _PLANS[variant] = _Plan(variant)
    ptr = lambda x: x.data_ptr() if x is not None else None  # noqa: E731
    a = Args(
        qkv=t.qkv.data_ptr(), positions=t.positions.data_ptr(), cos_sin=t.cos_sin_cache.data_ptr(),
        slot_mapping=t.slot_mapping.data_ptr(), index_slot_mapping=ptr(t.index_slot_mapping),
        q_norm_weight=t.q_norm_weight.data_ptr(), k_norm_weight=t.k_norm_weight.data_ptr(),
        index_q_norm_weight=ptr(t.index_q_norm_weight), index_k_norm_weight=ptr(t.index_k_norm_weight),
        k_scale=ptr(t.k_scale), v_scale=ptr(t.v_scale), q_out=t.q_out.data_ptr(),
        index_q_out=ptr(t.index_q_out), qkv_row_stride=t.qkv.stride(0),
        max_pos=t.cos_sin_cache.shape[0], num_slots=t.slot_mapping.numel(),
        num_index_slots=t.index_slot_mapping.numel() if t.index_slot_mapping is not None else 0,
        num_tokens=T, num_heads=t.num_heads, num_index_heads=t.num_index_heads, eps=t.eps)
    _cache_arg(a.k_cache, t.k_cache, plan.pages["k"])
    _cache_arg(a.v_cache, t.v_cache, plan.pages["v"])
    _cache_arg(a.index_cache, t.index_cache, plan.pages["index"])
    device = t.qkv.device
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            plan.lib.launch(a, _current_stream(device))
    else:
        plan.lib.launch(a, _current_stream(device))


def _impl(qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, slot_mapping: Tensor,
          k_cache: Optional[Tensor], v_cache: Optional[Tensor], kv_cache: Optional[Tensor],
          q_norm_weight: Tensor, k_norm_weight: Tensor, index_q_norm_weight: Optional[Tensor],
          index_k_norm_weight: Optional[Tensor], index_cache: Optional[Tensor],
          index_slot_mapping: Optional[Tensor], k_scale: Optional[Tensor], v_scale: Optional[Tensor],
          q_out: Tensor, index_q_out: Optional[Tensor], num_heads: int, num_kv_heads: int,
          num_index_heads: int, rotary_dim: int, eps: float, contract: str, index_mode: str,
          norm: str, checked: bool) -> None:
    _run(qkv, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, kv_cache, q_norm_weight,
         k_norm_weight, index_q_norm_weight, index_k_norm_weight, index_cache, index_slot_mapping,
         k_scale, v_scale, q_out, index_q_out, num_heads, num_kv_heads, num_index_heads, rotary_dim,
         eps, contract, index_mode, norm, checked, False)


def _run(qkv, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, kv_cache, q_norm_weight,
         k_norm_weight, index_q_norm_weight, index_k_norm_weight, index_cache, index_slot_mapping,
         k_scale, v_scale, q_out, index_q_out, num_heads, num_kv_heads, num_index_heads, rotary_dim,
         eps, contract, index_mode, norm, checked, force_reference) -> None:
    variant, t = check(
        contract=contract, index_mode=index_mode, norm=norm, qkv=qkv, positions=positions,
        cos_sin_cache=cos_sin_cache, slot_mapping=slot_mapping, k_cache=k_cache, v_cache=v_cache,
        kv_cache=kv_cache, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
        index_q_norm_weight=index_q_norm_weight, index_k_norm_weight=index_k_norm_weight,
        index_cache=index_cache, index_slot_mapping=index_slot_mapping, num_heads=num_heads,
        num_kv_heads=num_kv_heads, num_index_heads=num_index_heads, rotary_dim=rotary_dim, eps=eps,
        k_scale=k_scale, v_scale=v_scale, q_out=q_out, index_q_out=index_q_out)
    if checked:
        check_ranges(variant, t)
    if force_reference or t.qkv.device.type == "cpu":
        reference.run(variant, t)
    else:
        _launch(variant, t)


_OP = "kvforge::fused_qknorm_rope_cache"
_op = torch.library.custom_op(
    _OP, mutates_args=("k_cache", "v_cache", "kv_cache", "index_cache", "q_out", "index_q_out"),
)(_impl)


@_op.register_fake
def _fake(*args, **kwargs) -> None:
    return None


def fused_qknorm_rope_cache(
    qkv: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    slot_mapping: Tensor,
    k_cache: Optional[Tensor] = None,
    v_cache: Optional[Tensor] = None,
    *,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    contract: str,
    eps: float = 1e-6,
    kv_cache: Optional[Tensor] = None,
    num_index_heads: int = 0,
    index_q_norm_weight: Optional[Tensor] = None,
    index_k_norm_weight: Optional[Tensor] = None,
    index_cache: Optional[Tensor] = None,
    index_slot_mapping: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    q_out: Optional[Tensor] = None,
    index_q_out: Optional[Tensor] = None,
    index_mode: str = "full",
    norm: str = "gemma",
    checked: bool = False,
    _reference: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """QK RMSNorm + partial NeoX RoPE + KV-cache and index-cache insert, in one launch.

    Returns (q_out, index_q_out); index_q_out is None unless index_mode is 'full'.
    Outputs not passed in are allocated (index_q_out in the index cache's dtype).
    `checked=True` also validates every slot and position on the host (a sync).
    """
    if isinstance(q_norm_weight, Tensor) and isinstance(qkv, Tensor) and q_out is None:
        q_out = qkv.new_empty((qkv.shape[0], num_heads, q_norm_weight.numel()))
    if (index_mode == "full" and index_q_out is None and isinstance(index_cache, Tensor)
            and isinstance(qkv, Tensor) and isinstance(q_norm_weight, Tensor)):
        index_q_out = torch.empty((qkv.shape[0], num_index_heads, q_norm_weight.numel()),
                                  dtype=index_cache.dtype, device=qkv.device)
    args = (qkv, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, kv_cache, q_norm_weight,
            k_norm_weight, index_q_norm_weight, index_k_norm_weight, index_cache, index_slot_mapping,
            k_scale, v_scale, q_out, index_q_out, num_heads, num_kv_heads, num_index_heads, rotary_dim,
            float(eps), contract, index_mode, norm, checked)
    if _reference:
        _run(*args, force_reference=True)
    elif torch.compiler.is_compiling():
        _op(*args)
    else:
        _impl(*args)
    return q_out, (index_q_out if index_mode == "full" else None)


def reference_qknorm_rope_cache(*args, **kwargs) -> tuple[Tensor, Optional[Tensor]]:
    """`fused_qknorm_rope_cache` computed by the torch reference on any device."""
    return fused_qknorm_rope_cache(*args, _reference=True, **kwargs)
