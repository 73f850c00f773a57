"""Drop-in for vLLM's `fused_minimax_m3_qknorm_rope_kv_insert` (same argument list and defaults).

Upstream's list (vllm/_custom_ops.py), with `skip_index_branch`, `q_fp8_out` and
`q_fp8_scale` of its newest revisions; one call of `fused_qknorm_rope_cache` does what
vLLM's op does, by mutation, returning None:

- `qkv` is written in place, as vLLM does: K (normed, rotated, model dtype) always goes
  back into its k columns; q into `q_out` if given, else into its q columns; with
  `q_fp8_out` and no `q_out`, q is written only as FP8 and the q columns stay as they were
  (vLLM's later revisions). Where the index branch runs, index_q goes to `index_q_out` if
  given, else into its columns, and index_k into its column. V is never modified. (The
  kernel reads each element of a row before the thread that reads it writes it back, and
  the torch reference computes from a copy, so views of qkv are safe outputs.)
- Modes: no index heads (`num_index_heads=0`): dense rows, q and K only (index_mode
  'none'); index heads: the index branch (index_mode 'full'), or `skip_index_branch=True`:
  rows still carry the index heads, nothing index-related is read or written ('skip').
- `kv_cache` given: K and V inserted at `slot_mapping`, index_k into `index_cache` at
  `index_slot_mapping` (default: `slot_mapping`). Like vLLM, only on rows with index heads.
  Without it, no cache is written: the call runs on the scratch contract's one-page caches
  (runtime/engine_args.py's, whose dense and index variants are prebuilt) with no slots.
- `kv_cache` is vLLM's 4-D `[num_blocks, num_kv_heads, block_size, 2 * head_dim]` (K at
  `[..., :head_dim]`, V after it), laid out as its strides say: contiguous (HND, contract
  `vllm_m3`) or with a block's slots before its heads (NHD, `vllm_m3_nhd`); `block_size`
  must be its `size(2)`. `kv_cache_dtype`: 'auto' (the model dtype) or 'fp8' / 'fp8_e4m3'
  (uint8 storage, read as the platform's e4m3 flavour, or an e4m3 tensor) at vLLM's unit
  scale; 'fp8_e5m2' is not supported. The index cache `[num_blocks, block_size, head_dim]`
  (vLLM addresses it flat by slot, so any contiguous cache of rows of head_dim is read at a
  page size the contract allows) is in the model dtype or e4m3, as is `index_q_out`.
- `q_fp8_out = q / q_fp8_scale` (a dequantization scale, finite and > 0), saturating, from
  the rounded q.

What vLLM's op accepts is accepted: index tensors it does not read in the call's mode
(index weights, caches and slots with `skip_index_branch` or dense rows, every cache
argument without `kv_cache`) are ignored, not passed on; longer `positions` and slot
mappings are read for the first num_tokens entries; an output of the right size in
another shape is read as `[num_tokens, heads * head_dim]`. What it refuses raises here
(`kv_cache` on dense rows, `index_q_out` where the index branch does not run). Everything
else is validated by `fused_qknorm_rope_cache`, by the same names.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .api import fused_qknorm_rope_cache
from .engine_args import (SCRATCH, as_fp8, first_n, head_columns, index_cache_at, is_fp8, one_of,
                          scale_or_identity, scratch_caches)
from .validate import _absent, _dt, _given

Tensor = torch.Tensor

_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's get_fp8_kv_cache_data_type
def _q_scale(value, device: torch.device) -> Tensor:
    """vLLM's float q_fp8_scale as the device scalar the kernel reads (one per value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"q_fp8_scale: expected a finite positive float, got {_given(value)}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"q_fp8_scale: expected a finite positive float, got {value!r}")
    return _scale_tensor(device, float(value))


@functools.cache
def _scale_tensor(device: torch.device, value: float) -> Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _heads_after_block(t: Tensor) -> bool:
    """Dimensions 1.. of t contiguous (the block stride is free): size-1 dims match any stride."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _layout(kv_cache: Tensor) -> tuple[str, Tensor]:
    """The contract of a 4-D [blocks, nkv, block_size, 2D] cache and the tensor it takes: HND
    (contiguous but for the block stride) as is, NHD (a block's slots before its heads) as
    the [blocks, block_size, nkv, 2D] view. Any other strides: HND, whose check names them."""
    if not _heads_after_block(kv_cache) and _heads_after_block(kv_cache.transpose(1, 2)):
        return "vllm_m3_nhd", kv_cache.transpose(1, 2)
    return "vllm_m3", kv_cache


def _as_rows(out, num_tokens: Optional[int], heads, head_dim: Optional[int]):
    """vLLM takes any contiguous output of num_tokens * heads * head_dim elements: read one of
    another shape as [num_tokens, heads * head_dim]. Anything else is passed on as given."""
    if not isinstance(out, Tensor) or num_tokens is None or not head_dim or not isinstance(heads, int):
        return out
    n = heads * head_dim
    if out.shape in ((num_tokens, heads, head_dim), (num_tokens, n)):
        return out
    if out.is_contiguous() and out.numel() == num_tokens * n:
        return out.view(num_tokens, n)
    return out


def fused_minimax_m3_qknorm_rope_kv_insert(
    qkv: Tensor,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    eps: float,
    index_q_norm_weight: Optional[Tensor] = None,
    index_k_norm_weight: Optional[Tensor] = None,
    num_index_heads: int = 0,
    slot_mapping: Optional[Tensor] = None,
    index_slot_mapping: Optional[Tensor] = None,
    kv_cache: Optional[Tensor] = None,
    index_cache: Optional[Tensor] = None,
    block_size: int = 0,
    q_out: Optional[Tensor] = None,
    index_q_out: Optional[Tensor] = None,
    kv_cache_dtype: str = "auto",
    skip_index_branch: bool = False,
    q_fp8_out: Optional[Tensor] = None,
    q_fp8_scale: float = 1.0,
) -> None:
    """vLLM's op on kvforge: qkv normed and rotated in place, the caches written where given
    (the module's docstring says what goes where). Returns None."""
    one_of("kv_cache_dtype", kv_cache_dtype, _KV_CACHE_DTYPES)
    if not isinstance(skip_index_branch, bool):
        raise TypeError(f"skip_index_branch: expected a bool, got {_given(skip_index_branch)}")

    # The mode: rows with index heads or not (anything but the int 0 counts as index heads:
    # the native call then names a bad count).
    dense = isinstance(num_index_heads, int) and not isinstance(num_index_heads, bool) and num_index_heads == 0
    if dense:
        if skip_index_branch:
            raise ValueError("skip_index_branch: expected False (num_index_heads=0: dense rows have no index "
                             "heads to skip), got True")
        _absent("kv_cache", kv_cache, "num_index_heads=0: vLLM's op inserts into the caches only on rows with "
                                      "index heads (the sparse layer)")
        _absent("index_q_out", index_q_out, "num_index_heads=0: dense rows have no index branch")
        mode = "none"
    elif skip_index_branch:
        _absent("index_q_out", index_q_out, "skip_index_branch=True: the index branch is not processed")
        mode = "skip"
    else:
        mode = "full"
    if mode != "full":  # not read by vLLM's op in this mode
        index_q_norm_weight = index_k_norm_weight = index_slot_mapping = index_cache = None

    tensor_qkv = isinstance(qkv, Tensor) and qkv.dim() == 2
    n = qkv.shape[0] if tensor_qkv else None
    device = qkv.device if isinstance(qkv, Tensor) else None
    dtype = qkv.dtype if isinstance(qkv, Tensor) else torch.bfloat16
    D = q_norm_weight.numel() if isinstance(q_norm_weight, Tensor) and q_norm_weight.dim() == 1 else None
    counts = (num_heads, num_kv_heads, num_index_heads)
    known = D and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
    nkv = num_kv_heads if known and num_kv_heads > 0 else 1  # (for a dummy cache; a bad count is named)

    k_scale = v_scale = k_cache = v_cache = None
    if kv_cache is not None:
        if isinstance(kv_cache, Tensor):
            if kv_cache.dim() != 4:
                raise ValueError(f"kv_cache: expected a 4-D tensor [num_blocks, num_kv_heads, block_size, "
                                 f"2 * head_dim], got shape {tuple(kv_cache.shape)}")
            want = kv_cache.shape[2]
            if isinstance(block_size, bool) or not isinstance(block_size, int):
                raise TypeError(f"block_size: expected {want} (kv_cache.size(2)), got {_given(block_size)}")
            if block_size != want:
                raise ValueError(f"block_size: expected {want} (kv_cache.size(2)), got {block_size}")
            if kv_cache_dtype == "fp8_e5m2":
                raise ValueError("kv_cache_dtype: expected 'auto', 'fp8' or 'fp8_e4m3' (an e5m2 cache is not "
                                 "supported), got 'fp8_e5m2'")
            if kv_cache_dtype == "auto" and isinstance(qkv, Tensor) and kv_cache.dtype != qkv.dtype:
                raise TypeError(f"kv_cache: expected dtype {_dt(qkv.dtype)} (the dtype "
                                f"of qkv, kv_cache_dtype='auto'), got {_dt(kv_cache.dtype)}")
            kv_cache = as_fp8("kv_cache", kv_cache, kv_cache_dtype)
            k_scale = v_scale = scale_or_identity(None, kv_cache_dtype, kv_cache)  # vLLM's unit scale
            contract, kv_cache = _layout(kv_cache)
        else:
            contract = "vllm_m3"  # (not a tensor: the native call names it)
        positions, slot_mapping = first_n(positions, n), first_n(slot_mapping, n)
        index_slot_mapping = first_n(index_slot_mapping, n)
    else:
        # Nothing is inserted: the scratch contract's one-page caches that no slot addresses
        # (the index cache in the dtype of index_cache or else index_q_out), made once.
        contract = SCRATCH
        positions = first_n(positions, n)
        slot_mapping = index_slot_mapping = None
        if device is not None:
            like = index_cache if isinstance(index_cache, Tensor) else index_q_out
            k_cache, v_cache, scratch_index, slot_mapping = scratch_caches(
                device, dtype, like.dtype if is_fp8(like) else dtype, nkv, D or 128)
            if mode == "full":
                index_cache, index_slot_mapping = scratch_index, slot_mapping
    if mode == "full" and kv_cache is not None:
        index_cache = index_cache_at(index_cache, contract)  # vLLM addresses it flat: any page size

    if mode == "full" and index_q_out is None and is_fp8(index_cache):
        raise ValueError(f"index_q_out: expected a {_dt(index_cache.dtype)} tensor "
                         f"(index_cache is FP8: index_q is not written into qkv's columns), got None")

    # The outputs that are qkv's own columns: where its rows hold what the counts say (else
    # none, and the native call names what does not fit).
    q_cols = k_out = iq_cols = index_k_out = None
    if tensor_qkv and known:
        nq, niq = num_heads, num_index_heads
        row_heads = nq + 2 * nkv + (niq + 1 if mode != "none" else 0)
        if qkv.shape[1] == row_heads * D:
            q_cols, k_out = head_columns(qkv, 0, nq, D), head_columns(qkv, nq, nkv, D)
            if mode == "full":
                iq_cols = head_columns(qkv, nq + 2 * nkv, niq, D)
                index_k_out = head_columns(qkv, nq + 2 * nkv + niq, 1, D)
    if q_out is None and q_fp8_out is None:
        q_out = q_cols
    if mode == "full" and index_q_out is None:
        index_q_out = iq_cols
    scale = None
    if q_fp8_out is not None:
        scale = _q_scale(q_fp8_scale, device if device is not None else getattr(q_fp8_out, "device", "cpu"))

    fused_qknorm_rope_cache(
        qkv, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, kv_cache=kv_cache,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, num_heads=num_heads,
        num_kv_heads=num_kv_heads, rotary_dim=rotary_dim, contract=contract, eps=eps,
        num_index_heads=num_index_heads, index_q_norm_weight=index_q_norm_weight,
        index_k_norm_weight=index_k_norm_weight, index_cache=index_cache,
        index_slot_mapping=index_slot_mapping, k_scale=k_scale, v_scale=v_scale,
        q_out=_as_rows(q_out, n, num_heads, D), q_fp8_out=_as_rows(q_fp8_out, n, num_heads, D),
        q_fp8_scale=scale, k_out=k_out, index_q_out=_as_rows(index_q_out, n, num_index_heads, D),
        index_k_out=index_k_out, index_mode=mode)
