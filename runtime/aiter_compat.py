"""Drop-in for AITER's `minimax_m3_qknorm_rope_cache_shuffle_insert` (same argument list).

Semantics are SPEC §1-§3 with the `vllm_shuffle16` contract and NeoX rotary pairs (AITER's
op has no rotary-style argument). As in vLLM, an FP8 cache may arrive as raw uint8 with
`kv_cache_dtype` naming FP8; it is then read as the platform's flavour (e4m3fnuz on
gfx942, e4m3fn elsewhere).

What AITER's op accepts is mapped onto the native call's rules (SPEC §7): it reads the
first num_tokens entries of `positions`, `slot_mapping` and `index_slot_mapping` when
they are longer; it ignores `k_scale`/`v_scale` with `kv_cache_dtype="auto"`, and with an
FP8 one reads a missing or empty scale as the identity (here a per-tensor scale of 1.0,
the same bytes, which the contract's scale options hold); with `skip_index_branch=True`
it ignores every index tensor. Ignored arguments are not passed on (the native call
refuses them as meaningless). Everything else is validated by the native call, by the
same names.
"""
from __future__ import annotations

from typing import Optional

import torch

from .api import fused_qknorm_rope_cache

Tensor = torch.Tensor


def _platform_fp8(device: torch.device) -> torch.dtype:
    if torch.version.hip is not None and device.type == "cuda":
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if arch.startswith("gfx94"):
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def _as_fp8(name: str, t: Optional[Tensor], kv_cache_dtype: str) -> Optional[Tensor]:
    if not isinstance(t, Tensor) or not kv_cache_dtype.startswith("fp8"):
        return t  # None and non-tensors: the native call names them
    if t.dtype == torch.uint8:
        return t.view(_platform_fp8(t.device))
    if t.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise TypeError(f"{name}: expected dtype float8_e4m3fn, float8_e4m3fnuz or uint8 (kv_cache_dtype="
                        f"{kv_cache_dtype!r}), got {str(t.dtype).removeprefix('torch.')}")
    return t


def _first(t, n: Optional[int]):
    """AITER reads the first num_tokens entries of a longer index vector."""
    if n is not None and isinstance(t, Tensor) and t.dim() == 1 and t.shape[0] > n:
        return t[:n]
    return t


_ONES: dict = {}  # device -> fp32 [1] holding 1.0, the identity scale


def _scale(t, kv_cache_dtype: str, cache):
    """AITER: no scale with kv_cache_dtype 'auto'; a missing or empty one is the identity."""
    if kv_cache_dtype == "auto":
        return None
    if (t is None or (isinstance(t, Tensor) and t.numel() == 0)) and isinstance(cache, Tensor):
        ones = _ONES.get(cache.device)
        if ones is None:
            ones = _ONES[cache.device] = torch.ones(1, dtype=torch.float32, device=cache.device)
        return ones
    return t


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
        qkv, _first(positions, n), cos_sin_cache, _first(slot_mapping, n),
        _as_fp8("k_cache", k_cache, kv_cache_dtype), _as_fp8("v_cache", v_cache, kv_cache_dtype),
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, num_heads=num_heads,
        num_kv_heads=num_kv_heads, rotary_dim=rotary_dim, contract="vllm_shuffle16", eps=eps,
        num_index_heads=num_index_heads, index_q_norm_weight=index_q_norm_weight,
        index_k_norm_weight=index_k_norm_weight, index_cache=index_cache,
        index_slot_mapping=_first(index_slot_mapping, n), k_scale=_scale(k_scale, kv_cache_dtype, k_cache),
        v_scale=_scale(v_scale, kv_cache_dtype, k_cache), q_out=q_out, index_q_out=index_q_out,
        index_mode="skip" if skip_index_branch else "full")
