"""Drop-in for AITER's `minimax_m3_qknorm_rope_cache_shuffle_insert` (same argument list).

Semantics are SPEC §1-§3 with the `vllm_shuffle16` contract. As in vLLM, an FP8 cache
may arrive as raw uint8 with `kv_cache_dtype` naming FP8; it is then read as the
platform's flavour (e4m3fnuz on gfx942, e4m3fn elsewhere).
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
    if t is None or not kv_cache_dtype.startswith("fp8"):
        return t
    if t.dtype == torch.uint8:
        return t.view(_platform_fp8(t.device))
    if t.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise TypeError(f"{name}: kv_cache_dtype={kv_cache_dtype!r} needs an FP8 (or uint8) cache, "
                        f"got {t.dtype}")
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
    if kv_cache_dtype != "auto" and not kv_cache_dtype.startswith("fp8"):
        raise ValueError(f"kv_cache_dtype: expected 'auto' or an 'fp8…' name, got {kv_cache_dtype!r}")
    fused_qknorm_rope_cache(
        qkv, positions, cos_sin_cache, slot_mapping,
        _as_fp8("k_cache", k_cache, kv_cache_dtype), _as_fp8("v_cache", v_cache, kv_cache_dtype),
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, num_heads=num_heads,
        num_kv_heads=num_kv_heads, rotary_dim=rotary_dim, contract="vllm_shuffle16", eps=eps,
        num_index_heads=num_index_heads, index_q_norm_weight=index_q_norm_weight,
        index_k_norm_weight=index_k_norm_weight, index_cache=index_cache,
        index_slot_mapping=index_slot_mapping, k_scale=k_scale, v_scale=v_scale, q_out=q_out,
        index_q_out=index_q_out, index_mode="skip" if skip_index_branch else "full")
