"""The peer: the unfused torch path engines run today (norm + RoPE, then the cache
writes as separate ops), for any contract. Shapes never depend on data, so it can be
captured in a CUDA graph and compiled with torch.compile; benchmark slots are all valid.
"""
from __future__ import annotations

import torch

from kvforge.codegen.model import IndexMode, KvScale, Norm, QFp8, Rope, Saturation, Variant
from kvforge.codegen.layout import CacheAccess, access
from kvforge.runtime.reference import to_fp8, write_slots


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float, norm: Norm) -> torch.Tensor:
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return n * (1.0 + w.float() if norm is Norm.GEMMA else w.float())


# The engines' own arithmetic (multiply, then add), not the reference's: the peer is what
# engines run today, and the reference mirrors the fused kernel's fma instead.
def _rope(n: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
          rope: Rope) -> torch.Tensor:
    half = rotary_dim // 2
    cs = cos_sin[positions].float()
    c, s = cs[:, None, :half], cs[:, None, half:rotary_dim]
    if rope is Rope.GPTJ:  # interleaved pairs, as engines' is_neox=False paths split them
        a, b = n[..., 0:rotary_dim:2], n[..., 1:rotary_dim:2]
        return torch.cat([torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2), n[..., rotary_dim:]], -1)
    a, b = n[..., :half], n[..., half:rotary_dim]
    return torch.cat([a * c - b * s, b * c + a * s, n[..., rotary_dim:]], dim=-1)


def layouts(v: Variant) -> dict[str, CacheAccess]:
    """The contract's caches at this variant's sizes, looked up outside any trace."""
    return {c.role: access(v, c.role) for c in v.caches()}


def unfused(v: Variant, lay: dict[str, CacheAccess], a: dict, q_out: torch.Tensor, index_q_out) -> None:
    """Same outputs as the fused op (model-dtype rounding), written by separate torch ops."""
    D, R, nkv, nq = v.head_dim, v.rotary_dim, v.num_kv_heads, a["num_heads"]
    niq = a["num_index_heads"]
    T = a["qkv"].shape[0]
    x = a["qkv"].view(T, -1, D).float()
    pos, eps, model = a["positions"], a["eps"], a["qkv"].dtype

    def normed(lo: int, hi: int, w: torch.Tensor) -> torch.Tensor:
        return _rope(_norm(x[:, lo:hi], w, eps, v.norm), a["cos_sin_cache"], pos, R, v.rope)

    q = normed(0, nq, a["q_norm_weight"]).to(model)
    q_out.copy_(q.view_as(q_out))
    if v.q_fp8 is not QFp8.NONE:  # vLLM's scaled_fp8_quant of q
        q8 = a["q_fp8_out"]
        q8.copy_(to_fp8(q.float() * (1.0 / a["q_fp8_scale"]), v.fp8, True).view_as(q8))
    k32 = normed(nq, nq + nkv, a["k_norm_weight"])
    k = k32.to(model)
    vv = a["qkv"].view(T, -1, D)[:, nq + nkv:nq + 2 * nkv]
    k_cache = a.get("k_cache", a.get("kv_cache"))
    v_cache = a.get("v_cache", a.get("kv_cache"))
    if v.kv_scale.dynamic:  # AITER's per-token scales: amax / fp8 max, values divided by them
        sat = v.contract.saturation is Saturation.SATURATE
        k_amax, v_amax = k32.abs().amax(-1, keepdim=True), vv.float().abs().amax(-1, keepdim=True)
        ks = torch.where(k_amax > 0, k_amax / v.fp8.max, 1.0)
        vsc = torch.where(v_amax > 0, v_amax / v.fp8.max, 1.0)
        write_slots(lay["k_scale"], a["k_scale_cache"], a["slot_mapping"], ks)
        write_slots(lay["v_scale"], a["v_scale_cache"], a["slot_mapping"], vsc)
        k = to_fp8(k.float() / ks, v.fp8, sat)
        vv = to_fp8(vv.float() / vsc, v.fp8, sat)
    elif v.kv_scale is not KvScale.NONE:
        sat = v.contract.saturation is Saturation.SATURATE
        ks = (1.0 / a["k_scale"]).view(1, -1, 1) if "k_scale" in a else 1.0
        vs = (1.0 / a["v_scale"]).view(1, -1, 1) if "v_scale" in a else 1.0
        k = to_fp8(k.float() * ks, v.fp8, sat)
        vv = to_fp8(vv.float() * vs, v.fp8, sat)
    write_slots(lay["k"], k_cache, a["slot_mapping"], k)
    write_slots(lay["v"], v_cache, a["slot_mapping"], vv)
    if v.index_mode is not IndexMode.FULL:
        return
    base = nq + 2 * nkv
    iq = normed(base, base + niq, a["index_q_norm_weight"])
    ik = normed(base + niq, base + niq + 1, a["index_k_norm_weight"]).to(model)
    if v.index_fp8:
        index_q_out.copy_(to_fp8(iq, v.fp8, True).view_as(index_q_out))
        ik = to_fp8(ik.float(), v.fp8, True)
    else:
        index_q_out.copy_(iq.to(model).view_as(index_q_out))
    write_slots(lay["index"], a["index_cache"], a.get("index_slot_mapping", a["slot_mapping"]), ik)
