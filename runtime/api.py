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


def _cache_arg(dst, cache: Optional[Tensor], capacity_dim: int, page_size: int) -> None:
    if cache is None:
        return
    dst.data = cache.data_ptr()
    dst.capacity = cache.shape[capacity_dim] * page_size
    for i, s in enumerate(cache.stride()):
        dst.strides[i] = s


def _launch(variant, t: reference.Tensors) -> None:
    from codegen.layout import access

    T = t.qkv.shape[0]
    if T == 0:
        return
    a = Args()
    ptr = lambda x: x.data_ptr() if x is not None else None  # noqa: E731
    a.qkv = t.qkv.data_ptr()
    a.positions = t.positions.data_ptr()
    a.cos_sin = t.cos_sin_cache.data_ptr()
    a.slot_mapping = t.slot_mapping.data_ptr()
    a.index_slot_mapping = ptr(t.index_slot_mapping)
    a.q_norm_weight = t.q_norm_weight.data_ptr()
    a.k_norm_weight = t.k_norm_weight.data_ptr()
    a.index_q_norm_weight = ptr(t.index_q_norm_weight)
    a.index_k_norm_weight = ptr(t.index_k_norm_weight)
    a.k_scale = ptr(t.k_scale)
    a.v_scale = ptr(t.v_scale)
    a.q_out = t.q_out.data_ptr()
    a.index_q_out = ptr(t.index_q_out)
    for role, dst, cache in (("k", a.k_cache, t.k_cache), ("v", a.v_cache, t.v_cache),
                             ("index", a.index_cache, t.index_cache)):
        if cache is not None:
            acc = access(variant, role)
            _cache_arg(dst, cache, acc.runtime_dim, acc.page_size)
    a.qkv_row_stride = t.qkv.stride(0)
    a.max_pos = t.cos_sin_cache.shape[0]
    a.num_slots = t.slot_mapping.numel()
    a.num_index_slots = t.index_slot_mapping.numel() if t.index_slot_mapping is not None else 0
    a.num_tokens = T
    a.num_heads = t.num_heads
    a.num_index_heads = t.num_index_heads
    a.eps = t.eps
    lib = REGISTRY.get(variant)
    device = t.qkv.device
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            lib.launch(a, torch.cuda.current_stream(device).cuda_stream)
    else:
        lib.launch(a, torch.cuda.current_stream(device).cuda_stream)


def _impl(qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, slot_mapping: Tensor,
          k_cache: Optional[Tensor], v_cache: Optional[Tensor], kv_cache: Optional[Tensor],
          q_norm_weight: Tensor, k_norm_weight: Tensor, index_q_norm_weight: Optional[Tensor],
          index_k_norm_weight: Optional[Tensor], index_cache: Optional[Tensor],
          index_slot_mapping: Optional[Tensor], k_scale: Optional[Tensor], v_scale: Optional[Tensor],
          q_out: Tensor, index_q_out: Optional[Tensor], num_heads: int, num_kv_heads: int,
          num_index_heads: int, rotary_dim: int, eps: float, contract: str, index_mode: str,
          norm: str, checked: bool) -> None:
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
    if qkv.device.type == "cpu":
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
    fn = _op if torch.compiler.is_compiling() else _impl
    fn(qkv, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, kv_cache, q_norm_weight,
       k_norm_weight, index_q_norm_weight, index_k_norm_weight, index_cache, index_slot_mapping,
       k_scale, v_scale, q_out, index_q_out, num_heads, num_kv_heads, num_index_heads, rotary_dim,
       float(eps), contract, index_mode, norm, checked)
    return q_out, (index_q_out if index_mode == "full" else None)
