"""Drop-ins with AITER's argument lists: `minimax_m3_qknorm_rope_cache_shuffle_insert`
(PR #4813) and `fused_qknorm_idxrqknorm` (main, with PR #5143's modes).

Semantics are SPEC §1-§3 with NeoX rotary pairs (AITER's ops have no rotary-style
argument). As in vLLM, an FP8 cache may arrive as raw uint8 with `kv_cache_dtype` naming
FP8; it is then read as the platform's flavour (e4m3fnuz on gfx942, e4m3fn elsewhere).

What AITER's ops accept is mapped onto the native call's rules (SPEC §7): they read the
first num_tokens entries of `positions`, `slot_mapping` and `index_slot_mapping` when
they are longer; they ignore `k_scale`/`v_scale` with `kv_cache_dtype="auto"`, and #4813
reads a missing or empty FP8 scale as the identity (here a per-tensor scale of 1.0, the
same bytes, which the contract's scale options hold); with `skip_index_branch=True` they
ignore every index tensor. AITER addresses its index cache flat (row `slot` of
[-1, head_dim]); the contracts' index layout [ipages, page_size, D] is those addresses at
any page size, so an index cache whose page size the contract does not list is viewed at
one it does. Ignored arguments are not passed on (the native call refuses them as
meaningless). Everything else is validated by the native call, by the same names.
"""
from __future__ import annotations

from typing import Optional

import torch

from .api import fused_qknorm_rope_cache
from .engine_args import (FP8, SCRATCH, as_fp8, first_n, head_columns, index_cache_at, is_fp8, one_of, platform_fp8,
                          scale_or_identity, scratch_caches)
from .validate import _aligned, _dt, _given, _rows, _tensor

Tensor = torch.Tensor
def minimax_m3_qknorm_rope_cache_shuffle_insert(
    qkv: Tensor,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    num_heads: int,
    num_kv_heads: int,
    num_index_heads: int,
    rotary_dim: int,
    eps: float,
    slot_mapping: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    q_out: Tensor,
    index_q_norm_weight: Optional[Tensor] = None,
    index_k_norm_weight: Optional[Tensor] = None,
    index_slot_mapping: Optional[Tensor] = None,
    index_cache: Optional[Tensor] = None,
    index_q_out: Optional[Tensor] = None,
    kv_cache_dtype: str = "auto",
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    skip_index_branch: bool = False,
) -> None:
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype: expected 'auto' or an 'fp8…' name (a str), got "
                        f"{kv_cache_dtype!r} ({type(kv_cache_dtype).__name__})")
    if kv_cache_dtype != "auto" and not kv_cache_dtype.startswith("fp8"):
        raise ValueError(f"kv_cache_dtype: expected 'auto' or an 'fp8…' name, got {kv_cache_dtype!r}")
    n = qkv.shape[0] if isinstance(qkv, Tensor) and qkv.dim() > 0 else None
    if skip_index_branch:
        index_q_norm_weight = index_k_norm_weight = index_slot_mapping = index_cache = index_q_out = None
    fused_qknorm_rope_cache(
        qkv, first_n(positions, n), cos_sin_cache, first_n(slot_mapping, n),
        as_fp8("k_cache", k_cache, kv_cache_dtype), as_fp8("v_cache", v_cache, kv_cache_dtype),
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, num_heads=num_heads,
        num_kv_heads=num_kv_heads, rotary_dim=rotary_dim, contract="vllm_shuffle16", eps=eps,
        num_index_heads=num_index_heads, index_q_norm_weight=index_q_norm_weight,
        index_k_norm_weight=index_k_norm_weight, index_cache=index_cache_at(index_cache, "vllm_shuffle16"),
        index_slot_mapping=first_n(index_slot_mapping, n), k_scale=scale_or_identity(k_scale, kv_cache_dtype, k_cache),
        v_scale=scale_or_identity(v_scale, kv_cache_dtype, k_cache), q_out=q_out, index_q_out=index_q_out,
        index_mode="skip" if skip_index_branch else "full")


# ---- fused_qknorm_idxrqknorm (AITER main + PR #5143) ------------------------------------------
# kv_cache_dtype -> the scale the native call gets: per-token scales the op writes into
# k_scale/v_scale (ATOM, vLLM on ROCm), a cast (SGLang), a static per-tensor scale (#5143).
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e4m3_unit", "fp8_e4m3_static")
_PER_TOKEN = ("fp8", "fp8_e4m3")
_UNIT, _STATIC = "fp8_e4m3_unit", "fp8_e4m3_static"
def _positive(name: str, val, what: str) -> int:
    if isinstance(val, bool) or not isinstance(val, int):
        raise TypeError(f"{name}: expected {what}, got {_given(val)}")
    if val < 1:
        raise ValueError(f"{name}: expected {what}, got {val}")
    return val


def _not_fp8(name: str, cache, model: torch.dtype, dtype_arg: str) -> None:
    """A cache that `dtype_arg`='auto' says is in qkv's dtype, given as FP8 (or its uint8 storage)."""
    if isinstance(cache, Tensor) and (cache.dtype in FP8 or cache.dtype == torch.uint8):
        raise TypeError(f"{name}: expected dtype {_dt(model)} ({dtype_arg}='auto': the dtype of qkv), "
                        f"got {_dt(cache.dtype)}")


def _model_index_q_out(t: Tensor, qkv: Tensor, index_cache: Tensor, niq: int, D: int) -> None:
    """index_q_out in the model dtype beside an FP8 index cache, the one argument of the second
    launch the first does not validate: checked as validation would, before either launches."""
    _tensor("index_q_out", t, device=qkv.device)
    if t.dtype != qkv.dtype:
        raise TypeError(f"index_q_out: expected dtype {_dt(qkv.dtype)} (the dtype of qkv) or "
                        f"{_dt(index_cache.dtype)} (the dtype of index_cache), got "
                        f"{_dt(t.dtype)}")
    T = qkv.shape[0]
    if t.shape not in ((T, niq, D), (T, niq * D)):
        raise ValueError(f"index_q_out: expected shape ({T}, {niq}, {D}) or ({T}, {niq * D}), got {tuple(t.shape)}")
    _rows("index_q_out", t, niq * D)
    _aligned("index_q_out", t)


def fused_qknorm_idxrqknorm(
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
    kv_cache_k: Optional[Tensor] = None,
    kv_cache_v: Optional[Tensor] = None,
    index_cache: Optional[Tensor] = None,
    block_size: int = 0,
    q_out: Optional[Tensor] = None,
    index_q_out: Optional[Tensor] = None,
    index_slot_mapping: Optional[Tensor] = None,
    kv_cache_dtype: str = "auto",
    index_cache_dtype: Optional[str] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    asm_layout: bool = False,
    skip_index_branch: bool = False,
) -> None:
    """AITER's `fused_qknorm_idxrqknorm` (PR #5143's argument list and modes), on kvforge.

    Insert mode (kv_cache_k and kv_cache_v given): K and V into the caches, at
    `slot_mapping` (AITER's page-`block_size` SHUFFLE with asm_layout=True: contract
    vllm_shuffle16, block_size 16; else [num_blocks, block_size, nkv, D] views: aiter_nhd),
    index_k into `index_cache` at `index_slot_mapping` (default: slot_mapping); K and
    index_k are not written back into qkv. Without caches (non-insert mode), K and index_k
    are written in place into qkv and V is untouched. Either way q goes to q_out (default: in
    place into qkv's q columns) and index_q to index_q_out (default: in place).
    kv_cache_dtype: 'auto' (caches of qkv's dtype; k_scale/v_scale ignored), 'fp8' /
    'fp8_e4m3' (per-token scales the op writes into k_scale and v_scale: [num_blocks, nkv,
    block_size] with asm_layout, else [nkv, slots]), 'fp8_e4m3_unit' (a cast, no scale),
    'fp8_e4m3_static' (k_scale, v_scale: one-element fp32 inputs, values times 1/scale).
    index_cache_dtype None means 'fp8' where index_cache or index_q_out is an FP8 tensor.
    skip_index_branch: the rows still hold the index heads; nothing index-related is read
    or written, and the index arguments are ignored. Returns None.
    """
    one_of("kv_cache_dtype", kv_cache_dtype, _KV_CACHE_DTYPES)
    if index_cache_dtype is None:
        index_cache_dtype = "fp8" if is_fp8(index_cache) or is_fp8(index_q_out) else "auto"
    elif not isinstance(index_cache_dtype, str) or not (index_cache_dtype == "auto"
                                                        or index_cache_dtype.startswith("fp8")):
        raise (TypeError if not isinstance(index_cache_dtype, str) else ValueError)(
            f"index_cache_dtype: expected None, 'auto' or an 'fp8…' name, got {_given(index_cache_dtype)}")
    if isinstance(num_index_heads, bool) or not isinstance(num_index_heads, int):
        raise TypeError(f"num_index_heads: expected a non-negative integer, got {_given(num_index_heads)}")
    if num_index_heads < 0:
        raise ValueError(f"num_index_heads: expected a non-negative integer, got {num_index_heads}")
    index_mode = "none" if num_index_heads == 0 else "skip" if skip_index_branch else "full"
    if index_mode != "full":
        index_q_norm_weight = index_k_norm_weight = index_cache = index_q_out = index_slot_mapping = None
    n = qkv.shape[0] if isinstance(qkv, Tensor) and qkv.dim() > 0 else None
    D = q_norm_weight.numel() if isinstance(q_norm_weight, Tensor) else 128
    nq = _positive("num_heads", num_heads, "a positive integer")
    nkv = _positive("num_kv_heads", num_kv_heads, "a positive integer")
    model = qkv.dtype if isinstance(qkv, Tensor) else torch.bfloat16
    device = qkv.device if isinstance(qkv, Tensor) else torch.device("cpu")
    common = dict(q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, num_heads=nq, num_kv_heads=nkv,
                  rotary_dim=rotary_dim, eps=eps, num_index_heads=num_index_heads,
                  index_q_norm_weight=index_q_norm_weight, index_k_norm_weight=index_k_norm_weight,
                  index_mode=index_mode)
    positions = first_n(positions, n)
    if index_cache_dtype != "auto" and isinstance(index_q_out, Tensor) and index_q_out.dtype == torch.uint8:
        index_q_out = index_q_out.view(platform_fp8(index_q_out.device))
    if q_out is None:
        q_out = head_columns(qkv, 0, nq, D)
    index_heads = nq + 2 * nkv
    if index_mode == "full" and index_q_out is None:
        index_q_out = head_columns(qkv, index_heads, num_index_heads, D)

    if kv_cache_k is None and kv_cache_v is None:
        # Non-insert mode: q, K, index_q and index_k rotated in place (or into q_out /
        # index_q_out), V and every cache untouched: no slot addresses the dummy caches.
        iq_dtype = index_q_out.dtype if isinstance(index_q_out, Tensor) else model
        k, v, index, no_slots = scratch_caches(device, model, iq_dtype, nkv, D)
        full = index_mode == "full"
        fused_qknorm_rope_cache(
            qkv, positions, cos_sin_cache, no_slots, k, v, contract=SCRATCH, q_out=q_out,
            k_out=head_columns(qkv, nq, nkv, D), index_cache=index if full else None,
            index_slot_mapping=no_slots if full else None, index_q_out=index_q_out,
            index_k_out=head_columns(qkv, index_heads + num_index_heads, 1, D) if full else None, **common)
        return
    if kv_cache_k is None or kv_cache_v is None:
        given, missing = ("kv_cache_k", "kv_cache_v") if kv_cache_v is None else ("kv_cache_v", "kv_cache_k")
        raise ValueError(f"{missing}: expected a tensor ({given} is given: pass both caches or neither), got None")

    # Insert mode: the layout, its page size and the scales.
    contract = "vllm_shuffle16" if asm_layout else "aiter_nhd"
    if asm_layout:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size != 16:
            raise (ValueError if isinstance(block_size, int) else TypeError)(
                f"block_size: expected 16 (asm_layout=True: SHUFFLE pages of 16 slots), got {_given(block_size)}")
        page_dim = 3
    else:
        _positive("block_size", block_size, "a positive integer (the page size of kv_cache_k and kv_cache_v)")
        page_dim = 1
    for name, cache in (("kv_cache_k", kv_cache_k),) if asm_layout else (("kv_cache_k", kv_cache_k),
                                                                         ("kv_cache_v", kv_cache_v)):
        if isinstance(cache, Tensor) and cache.dim() > page_dim and cache.shape[page_dim] != block_size:
            raise ValueError(f"{name}: expected pages of block_size={block_size} slots (dimension {page_dim}), "
                             f"got shape {tuple(cache.shape)}")
    scales: dict = {}
    if kv_cache_dtype == "auto":
        for name, cache in (("kv_cache_k", kv_cache_k), ("kv_cache_v", kv_cache_v)):
            _not_fp8(name, cache, model, "kv_cache_dtype")
    else:
        kv_cache_k = as_fp8("kv_cache_k", kv_cache_k, kv_cache_dtype)
        kv_cache_v = as_fp8("kv_cache_v", kv_cache_v, kv_cache_dtype)
        if kv_cache_dtype == _UNIT:
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                if s is not None:
                    raise ValueError(f"{name}: expected None (kv_cache_dtype={_UNIT!r} takes no scale), got {_given(s)}")
            if asm_layout:  # SHUFFLE holds no unit scale: a per-tensor 1.0 stores the same bytes
                scales = dict(k_scale=scale_or_identity(None, kv_cache_dtype, kv_cache_k),
                              v_scale=scale_or_identity(None, kv_cache_dtype, kv_cache_k))
        else:
            what = ("a float32 tensor the op fills with per-token scales" if kv_cache_dtype in _PER_TOKEN
                    else "a one-element float32 tensor (a static scale)")
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                if s is None:
                    raise ValueError(f"{name}: expected {what} (kv_cache_dtype={kv_cache_dtype!r}), got None")
            if kv_cache_dtype == _STATIC:
                scales = dict(k_scale=k_scale, v_scale=v_scale)
            else:
                if asm_layout:  # AITER indexes [num_blocks, nkv, block_size] flat
                    k_scale, v_scale = (s.view(-1, nkv, block_size) if isinstance(s, Tensor) and s.dim() != 3
                                        and s.is_contiguous() and s.numel() % (nkv * block_size) == 0 else s
                                        for s in (k_scale, v_scale))
                scales = dict(k_scale_cache=k_scale, v_scale_cache=v_scale)

    slot_mapping = first_n(slot_mapping, n)
    aux = False  # index_q in the model dtype beside an FP8 index cache: a second launch
    if index_mode == "full":
        if index_slot_mapping is None:
            index_slot_mapping = slot_mapping
        index_slot_mapping = first_n(index_slot_mapping, n)
        if index_cache_dtype == "auto":
            _not_fp8("index_cache", index_cache, model, "index_cache_dtype")
        else:
            index_cache = as_fp8("index_cache", index_cache, index_cache_dtype)
            aux = is_fp8(index_cache) and isinstance(index_q_out, Tensor) and not is_fp8(index_q_out)
            if aux and isinstance(qkv, Tensor) and qkv.dim() == 2:
                _model_index_q_out(index_q_out, qkv, index_cache, num_index_heads, D)
        index_cache = index_cache_at(index_cache, contract)
    fused_qknorm_rope_cache(
        qkv, positions, cos_sin_cache, slot_mapping, kv_cache_k, kv_cache_v, contract=contract, q_out=q_out,
        index_cache=index_cache, index_slot_mapping=index_slot_mapping, index_q_out=None if aux else index_q_out,
        **scales, **common)
    if aux:
        # The FP8 index cache's variant writes index_q as FP8 (to a scratch output above);
        # the model-dtype index_q comes from a launch that writes no cache. It reads only
        # index_q's columns of qkv, which the launch above left as they were.
        k, v, index, no_slots = scratch_caches(device, model, index_q_out.dtype, nkv, D)
        fused_qknorm_rope_cache(qkv, positions, cos_sin_cache, no_slots, k, v, contract=SCRATCH, index_cache=index,
                                index_slot_mapping=no_slots, index_q_out=index_q_out, **common)
