"""Independent per-token, per-head loop oracle for SPEC §1-§2 (layout-free).

Written only from the SPEC text, deliberately slow and simple, so it can cross-check the
vectorized torch reference.  All arithmetic is IEEE fp32 done one operation at a time
(Python doubles rounded to fp32 after every +, -, *, /, sqrt; no FMA), summation is
sequential.  torch is used only to round small vectors to bf16/fp16/fp8.
"""
from array import array
import math

import torch

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
# Without saturation, magnitudes that round past the max are NaN.  torch's own cast saturates
# e4m3fn (1000 -> 448), so the overflow region is handled here explicitly, not by torch.
# e4m3fn: 464 is the midpoint 448|480 and ties to even (448), so NaN only for |v| > 464.
# e4m3fnuz: 248 is the midpoint 240|256 and ties to even (256, out of range), so NaN for >= 248.
_FP8_NAN_FROM = {torch.float8_e4m3fn: (464.0, False), torch.float8_e4m3fnuz: (248.0, True)}


def f32(x):
    """Round a Python float to fp32 (array('f') casts like C: round-to-nearest, inf on overflow).
    A single +,-,*,/,sqrt of fp32 operands done in double and rounded once is exactly the
    fp32 IEEE result, so applying this after every operation gives true fp32 math."""
    return array("f", [x])[0]


def to_dtype(vals, dtype):
    """Round a list of fp32 values to a model dtype (bf16/fp16), round-to-nearest-even."""
    return torch.tensor(vals, dtype=torch.float32).to(dtype)


def to_fp8(vals, fp8, saturate):
    """Quantize a list of fp32 values (already scaled) to FP8 per SPEC §2."""
    mx = _FP8_MAX[fp8]
    if saturate:
        vals = [min(max(v, -mx), mx) for v in vals]
    codes = torch.tensor(vals, dtype=torch.float32).to(fp8).view(torch.uint8).tolist()
    lim, inclusive = _FP8_NAN_FROM[fp8]
    for i, v in enumerate(vals):
        if abs(v) > lim or (inclusive and abs(v) >= lim):
            # e4m3fn NaN is S.1111.111 (keeps the sign); e4m3fnuz has a single NaN, 0x80.
            codes[i] = (0xFF if v < 0 else 0x7F) if fp8 == torch.float8_e4m3fn else 0x80
    return torch.tensor(codes, dtype=torch.uint8).view(fp8)


def rmsnorm(x, w, eps, norm):
    """SPEC §1 step 1, fp32: x * (1/sqrt(mean(x^2) + eps)) * (1 + w)  (or * w for 'plain')."""
    acc = 0.0
    for v in x:
        acc = f32(acc + f32(v * v))
    mean = f32(acc / len(x))
    inv = f32(1.0 / f32(math.sqrt(f32(mean + f32(eps)))))
    out = []
    for v, wd in zip(x, w):
        g = f32(1.0 + wd) if norm == "gemma" else wd
        out.append(f32(f32(v * inv) * g))
    return out


def rope(n, cs_row, rotary_dim, style="neox"):
    """SPEC §1 step 2: partial RoPE, dims >= R pass through; pairs (i, i+h) (NeoX) or
    (2i, 2i+1) (GPT-J), both at c_i, s_i."""
    h = rotary_dim // 2
    y = list(n)
    for i in range(h):
        a, b = (i, i + h) if style == "neox" else (2 * i, 2 * i + 1)
        c, s = cs_row[i], cs_row[h + i]
        y[a] = f32(f32(n[a] * c) - f32(n[b] * s))
        y[b] = f32(f32(n[b] * c) + f32(n[a] * s))
    return y


def _scales(scale, nkv, name):
    """None -> 1; [s] -> per tensor; [s]*nkv -> per head.  Returns per-head fp32 1/scale."""
    if scale is None:
        scale = [1.0]
    scale = [float(s) for s in scale]
    if len(scale) not in (1, nkv):
        raise ValueError(f"{name}: expected 1 or {nkv} scales, got {len(scale)}")
    inv = [f32(1.0 / f32(s)) for s in scale]  # 1/scale computed in fp32, then multiplied
    return inv * nkv if len(inv) == 1 else inv


def spec_forward(*, qkv, positions, cos_sin_cache, slot_mapping, index_slot_mapping,
                 q_w, k_w, iq_w, ik_w, num_heads, num_kv_heads, num_index_heads,
                 rotary_dim, eps, norm="gemma", rope_style="neox", index_mode="full",
                 kv_fp8=None, k_scale=None, v_scale=None, saturate=True,
                 index_fp8=None, round_before_quant=True, per_token=False, q_fp8=None, q_fp8_scale=None):
    """per_token: K/V scales per (token, kv head), amax of the fp32 values / the FP8 max (1 if
    zero), which the values are divided by (AITER). q_fp8 (a dtype) with q_fp8_scale: the
    FP8 query output, q rounded then times 1/scale, saturating."""
    assert norm in ("gemma", "plain") and rope_style in ("neox", "gptj") and index_mode in ("full", "skip", "none")
    dt = qkv.dtype
    D = q_w.numel()
    nq, nkv, niq, R = num_heads, num_kv_heads, num_index_heads, rotary_dim
    assert R % 2 == 0 and 0 <= R <= D
    T, W = qkv.shape
    has_index = index_mode != "none"
    assert W == (nq + 2 * nkv) * D + ((niq + 1) * D if has_index else 0), "row width"
    do_index = index_mode == "full"

    wq, wk = q_w.float().tolist(), k_w.float().tolist()
    if do_index:
        wiq, wik = iq_w.float().tolist(), ik_w.float().tolist()
    # Scales only exist for an FP8 KV cache (granularity 'none' = model-dtype cache, no scale).
    inv_k = _scales(k_scale, nkv, "k_scale") if kv_fp8 is not None else None
    inv_v = _scales(v_scale, nkv, "v_scale") if kv_fp8 is not None else None
    slots = slot_mapping.tolist()
    islots = index_slot_mapping.tolist() if do_index else []

    def head(row, i):
        return row[i * D:(i + 1) * D]

    def quant_src(y):
        """Value K/index_k are quantized from: the model-dtype-rounded one by default."""
        return to_dtype(y, dt).float().tolist() if round_before_quant else y

    q_out, q8_out, iq_out, k_out, v_out, idx_out, k_sc, v_sc = [], [], [], {}, {}, {}, {}, {}
    inv_q = f32(1.0 / f32(float(q_fp8_scale))) if q_fp8 is not None else None
    for t in range(T):
        row = qkv[t].float().tolist()  # exact: bf16/fp16 -> fp32
        cs = cos_sin_cache[int(positions[t])].float().tolist()
        qs, ks = row[:nq * D], row[nq * D:(nq + nkv) * D]
        vs = row[(nq + nkv) * D:(nq + 2 * nkv) * D]

        def rot(x, w):
            return rope(rmsnorm(x, w, eps, norm), cs, R, rope_style)

        q_out.append(to_dtype([rot(head(qs, h), wq) for h in range(nq)], dt))
        if q_fp8 is not None:
            q8_out.append(torch.stack([to_fp8([f32(v * inv_q) for v in qh.float().tolist()], q_fp8, True)
                                       for qh in q_out[-1]]))

        # K / V: only tokens t < len(slot_mapping) with slot >= 0 are written.
        slot = slots[t] if t < len(slots) else -1
        if slot >= 0:
            krows, vrows = [], []
            for h in range(nkv):
                ky, vx = rot(head(ks, h), wk), head(vs, h)
                if kv_fp8 is None:
                    krows.append(to_dtype(ky, dt))
                    vrows.append(to_dtype(vx, dt))  # V is raw: exact copy of the input
                elif per_token:
                    sk = f32(max(abs(v) for v in ky) / _FP8_MAX[kv_fp8]) or 1.0
                    sv = f32(max(abs(v) for v in vx) / _FP8_MAX[kv_fp8]) or 1.0
                    krows.append(to_fp8([f32(v / sk) for v in quant_src(ky)], kv_fp8, saturate))
                    vrows.append(to_fp8([f32(v / sv) for v in vx], kv_fp8, saturate))
                    k_sc.setdefault(t, (slot, []))[1].append(sk)
                    v_sc.setdefault(t, (slot, []))[1].append(sv)
                else:
                    krows.append(to_fp8([f32(v * inv_k[h]) for v in quant_src(ky)], kv_fp8, saturate))
                    vrows.append(to_fp8([f32(v * inv_v[h]) for v in vx], kv_fp8, saturate))
            k_out[t] = (slot, torch.stack(krows))
            v_out[t] = (slot, torch.stack(vrows))

        if do_index:
            base = (nq + 2 * nkv) * D
            iqs, ik = row[base:base + niq * D], row[base + niq * D:base + (niq + 1) * D]
            iys = [rot(head(iqs, h), wiq) for h in range(niq)]
            if index_fp8 is None:
                iq_out.append(to_dtype(iys, dt))
            else:  # index_q: straight from fp32, unit scale, always saturating
                iq_out.append(torch.stack([to_fp8(y, index_fp8, True) for y in iys]))
            islot = islots[t] if t < len(islots) else -1
            if islot >= 0:
                iky = rot(ik, wik)
                val = to_dtype(iky, dt) if index_fp8 is None else to_fp8(quant_src(iky), index_fp8, True)
                idx_out[t] = (islot, val)

    empty = torch.empty(0, nq, D, dtype=dt)
    return {
        "q_out": torch.stack(q_out) if T else empty,
        "q_fp8_out": torch.stack(q8_out) if q8_out else None,
        "k_scale": k_sc,
        "v_scale": v_sc,
        "index_q_out": (torch.stack(iq_out) if T else torch.empty(0, niq, D, dtype=index_fp8 or dt))
        if do_index else None,
        "k": k_out,
        "v": v_out,
        "index": idx_out,
    }
