"""SPEC §7: check every argument before any launch and derive the signature.

Each problem raises ValueError or TypeError naming the argument, what was expected
and what was given. Nothing here writes to any tensor. The result is the Variant to
dispatch to and the tensors the kernel (or the reference) consumes.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvforge.codegen.layout import VEC, access
from kvforge.codegen.model import IndexMode, IndexSlots, PointError, Variant, make_variant

from .reference import FP8_DTYPES, Tensors
from .registry import spec

MODEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
COS_SIN_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP8_NAMES = {dt: f.value for f, dt in FP8_DTYPES.items()}
_SIGNATURES: dict[tuple, Variant] = {}  # derived axis values -> variant (make_variant once)


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _tensor(name: str, t, *, device: Optional[torch.device] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where qkv is), got {t.device}")
    return t


def _dtype(name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}, got {str(t.dtype).removeprefix('torch.')}")


def _rank(name: str, t: torch.Tensor, rank: int, what: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor {what}, got shape {_shape(t)}")


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def _aligned(name: str, t: torch.Tensor) -> None:
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: expected a 16-byte aligned data pointer (the kernel moves 16-byte "
                         f"vectors), got address {t.data_ptr():#x}")


def _slots(name: str, t, device, num_tokens: int) -> torch.Tensor:
    _tensor(name, t, device=device)
    _dtype(name, t, (torch.int64,))
    _rank(name, t, 1, "[num_tokens]")
    _contiguous(name, t)
    if t.numel() > num_tokens:
        raise ValueError(f"{name}: expected at most num_tokens={num_tokens} entries, got {t.numel()}")
    return t


def _weight(name: str, t, device, dtype, head_dim: int) -> torch.Tensor:
    _tensor(name, t, device=device)
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {str(dtype).removeprefix('torch.')} (the dtype of qkv), "
                        f"got {str(t.dtype).removeprefix('torch.')}")
    if t.dim() != 1 or t.numel() != head_dim:
        raise ValueError(f"{name}: expected shape ({head_dim},) (head_dim, the size of q_norm_weight), "
                         f"got {_shape(t)}")
    _contiguous(name, t)
    _aligned(name, t)
    return t


def _fp8_flavour(names_tensors) -> Optional[str]:
    """The FP8 flavour the FP8 tensors agree on (None if none is FP8)."""
    seen = {n: FP8_NAMES[t.dtype] for n, t in names_tensors if t is not None and t.dtype in FP8_NAMES}
    if len(set(seen.values())) > 1:
        detail = ", ".join(f"{n} is {f}" for n, f in seen.items())
        raise TypeError(f"FP8 tensors must share one flavour: {detail}")
    return next(iter(seen.values()), None)


def _scale_kind(name: str, t, device, nkv: int) -> str:
    if t is None:
        return "unit"
    _tensor(name, t, device=device)
    _dtype(name, t, (torch.float32,))
    _contiguous(name, t)
    if t.numel() == 1:
        return "per_tensor"
    if t.dim() == 1 and t.numel() == nkv:
        return "per_head"
    raise ValueError(f"{name}: expected shape (1,) (per tensor) or ({nkv},) (per kv head), got {_shape(t)}")


def _cache(v: Variant, role: str, name: str, t: torch.Tensor) -> None:
    acc = access(v, role)
    shape = t.shape
    if len(shape) != len(acc.extents) or any(e is not None and s != e for s, e in zip(shape, acc.extents)):
        expected = [getattr(v.contract, role).runtime_name if e is None else str(e) for e in acc.extents]
        raise ValueError(f"{name}: expected shape [{', '.join(expected)}] for contract "
                         f"{v.contract.name} with this signature, got {_shape(t)}")
    if shape[acc.runtime_dim] < 1:
        raise ValueError(f"{name}: the cache holds no page "
                         f"({getattr(v.contract, role).runtime_name} = 0)")
    for i, (size, stride, want) in enumerate(zip(t.shape, t.stride(), acc.contiguous_strides)):
        if want is None:
            if (stride * t.element_size()) % 16:
                raise ValueError(f"{name}: the stride of dimension {i} must be a multiple of 16 bytes, "
                                 f"got {stride} elements")
        elif size > 1 and stride != want:
            raise ValueError(f"{name}: dimension {i} must be contiguous (stride {want}) for contract "
                             f"{v.contract.name}; got strides {tuple(t.stride())}")
    _aligned(name, t)


def check(*, contract: str, index_mode: str, norm: str, qkv, positions, cos_sin_cache, slot_mapping,
          k_cache, v_cache, kv_cache, q_norm_weight, k_norm_weight, index_q_norm_weight,
          index_k_norm_weight, index_cache, index_slot_mapping, num_heads: int, num_kv_heads: int,
          num_index_heads: int, rotary_dim: int, eps: float, k_scale, v_scale, q_out, index_q_out,
          ) -> tuple[Variant, Tensors]:
    contracts = spec().contracts
    if contract not in contracts:
        raise ValueError(f"contract: expected one of {', '.join(sorted(contracts))}, got {contract!r}")
    c = contracts[contract]
    try:
        mode = IndexMode.parse(index_mode)
    except ValueError as e:
        raise ValueError(f"index_mode: {e}") from None

    _tensor("qkv", qkv)
    device = qkv.device
    _dtype("qkv", qkv, tuple(MODEL_DTYPES))
    _rank("qkv", qkv, 2, "[num_tokens, row]")
    if qkv.stride(1) != 1 or qkv.stride(0) % VEC:
        raise ValueError(f"qkv: expected rows of contiguous elements whose row stride is a multiple of "
                         f"{VEC}, got strides {tuple(qkv.stride())}")
    _aligned("qkv", qkv)
    T = qkv.shape[0]
    for name, val in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}: expected a positive integer, got {val!r}")
    if isinstance(num_index_heads, bool) or not isinstance(num_index_heads, int) or num_index_heads < 0:
        raise ValueError(f"num_index_heads: expected a non-negative integer, got {num_index_heads!r}")
    _tensor("q_norm_weight", q_norm_weight, device=device)
    D = q_norm_weight.numel()
    _weight("q_norm_weight", q_norm_weight, device, qkv.dtype, D)
    _weight("k_norm_weight", k_norm_weight, device, qkv.dtype, D)
    row_heads = num_heads + 2 * num_kv_heads + (num_index_heads + 1 if mode is not IndexMode.NONE else 0)
    if qkv.shape[1] != row_heads * D:
        parts = f"num_heads={num_heads} + 2*num_kv_heads={num_kv_heads}"
        if mode is not IndexMode.NONE:
            parts += f" + num_index_heads={num_index_heads} + 1 index_k head"
        raise ValueError(f"qkv: a row of {qkv.shape[1]} elements does not hold {parts} heads of "
                         f"head_dim {D} (= {row_heads * D}, index_mode {mode.value})")
    if mode is IndexMode.FULL and num_index_heads < 1:
        raise ValueError("num_index_heads: index_mode 'full' needs at least one index head, got 0")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > D:
        raise ValueError(f"rotary_dim: expected an even number in [2, head_dim={D}], got {rotary_dim!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"eps: expected a positive float, got {eps!r}")

    _tensor("positions", positions, device=device)
    _dtype("positions", positions, (torch.int64,))
    _rank("positions", positions, 1, "[num_tokens]")
    _contiguous("positions", positions)
    if positions.numel() != T:
        raise ValueError(f"positions: expected {T} entries (one per qkv row), got {positions.numel()}")
    _tensor("cos_sin_cache", cos_sin_cache, device=device)
    _dtype("cos_sin_cache", cos_sin_cache, tuple(COS_SIN_DTYPES))
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache: expected shape [max_pos, rotary_dim={rotary_dim}], got {_shape(cos_sin_cache)}")
    if cos_sin_cache.shape[0] < 1:
        raise ValueError("cos_sin_cache: expected at least one row (position), got shape "
                         f"{_shape(cos_sin_cache)}")
    _contiguous("cos_sin_cache", cos_sin_cache)
    _aligned("cos_sin_cache", cos_sin_cache)
    _slots("slot_mapping", slot_mapping, device, T)

    # K/V caches: one combined tensor or two, as the contract says.
    if c.combined_kv:
        if kv_cache is None or k_cache is not None or v_cache is not None:
            raise ValueError(f"kv_cache: contract {contract} stores K and V in one tensor; pass kv_cache= "
                             "and not k_cache/v_cache")
        k_cache = v_cache = _tensor("kv_cache", kv_cache, device=device)
        k_name = v_name = "kv_cache"
    else:
        if kv_cache is not None or k_cache is None or v_cache is None:
            raise ValueError(f"k_cache: contract {contract} keeps K and V in two tensors; pass k_cache= "
                             "and v_cache= (not kv_cache)")
        _tensor("k_cache", k_cache, device=device)
        _tensor("v_cache", v_cache, device=device)
        k_name, v_name = "k_cache", "v_cache"
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"v_cache: expected the dtype of k_cache ({k_cache.dtype}), got {v_cache.dtype}")
    _dtype(k_name, k_cache, (qkv.dtype, *FP8_NAMES))

    full = mode is IndexMode.FULL
    if full:
        for name, val in (("index_q_norm_weight", index_q_norm_weight),
                          ("index_k_norm_weight", index_k_norm_weight), ("index_cache", index_cache)):
            if val is None:
                raise ValueError(f"{name}: required with index_mode 'full', got None")
        _weight("index_q_norm_weight", index_q_norm_weight, device, qkv.dtype, D)
        _weight("index_k_norm_weight", index_k_norm_weight, device, qkv.dtype, D)
        _tensor("index_cache", index_cache, device=device)
        _dtype("index_cache", index_cache, (qkv.dtype, *FP8_NAMES))
        if index_slot_mapping is None:
            if c.index_slots is IndexSlots.OWN:
                raise ValueError(f"index_slot_mapping: contract {contract} requires its own index slots, got None")
            index_slot_mapping = slot_mapping
        _slots("index_slot_mapping", index_slot_mapping, device, T)
        if index_q_out is not None:
            _tensor("index_q_out", index_q_out, device=device)
            if (index_q_out.dtype in FP8_NAMES) != (index_cache.dtype in FP8_NAMES) or \
                    index_q_out.dtype not in (qkv.dtype, *FP8_NAMES):
                raise TypeError(f"index_q_out: expected the index dtype of index_cache "
                                f"({index_cache.dtype}), got {index_q_out.dtype}")
    fp8 = _fp8_flavour([(k_name, k_cache), ("index_cache", index_cache if full else None),
                        ("index_q_out", index_q_out if full else None)])
    kv_fp8 = k_cache.dtype in FP8_NAMES
    if kv_fp8:
        ks = _scale_kind("k_scale", k_scale, device, num_kv_heads)
        vs = _scale_kind("v_scale", v_scale, device, num_kv_heads)
        if ks != vs:
            raise ValueError(f"v_scale: expected the granularity of k_scale ({ks}), got {vs}")
        kv_scale = ks
    else:
        kv_scale, k_scale, v_scale = "none", None, None  # a bf16/fp16 cache takes no scale

    point = {
        "contract": contract, "dtype": MODEL_DTYPES[qkv.dtype], "head_dim": D, "rotary_dim": rotary_dim,
        "num_kv_heads": num_kv_heads, "cos_sin": COS_SIN_DTYPES[cos_sin_cache.dtype], "norm": norm,
        "index_mode": mode.value,
        "index_dtype": "fp8" if full and index_cache.dtype in FP8_NAMES else "model",
        "kv_scale": kv_scale, "fp8": fp8 or "e4m3fn",
    }
    key = tuple(point.values())
    variant = _SIGNATURES.get(key)
    if variant is None:
        try:
            variant = _SIGNATURES[key] = make_variant(contracts, point)
        except PointError as e:
            raise ValueError(f"unsupported signature: {e.axis}: {e}") from None

    _cache(variant, "k", k_name, k_cache)
    if not c.combined_kv:
        _cache(variant, "v", v_name, v_cache)
    if full:
        _cache(variant, "index", "index_cache", index_cache)
    for name, out, heads, dtypes in (("q_out", q_out, num_heads, (qkv.dtype,)),
                                     ("index_q_out", index_q_out if full else None, num_index_heads,
                                      (index_cache.dtype if full else None,))):
        if out is None and (name == "q_out" or full):
            # the public function allocates it; the op itself (torch.ops) needs it passed
            raise ValueError(f"{name}: required (an output the kernel writes), got None")
        if out is None:
            continue
        _tensor(name, out, device=device)
        _dtype(name, out, dtypes)
        if out.shape not in ((T, heads, D), (T, heads * D)):
            raise ValueError(f"{name}: expected shape ({T}, {heads}, {D}), got {_shape(out)}")
        _contiguous(name, out)
        _aligned(name, out)
    tensors = Tensors(
        qkv=qkv, positions=positions, cos_sin_cache=cos_sin_cache, slot_mapping=slot_mapping,
        index_slot_mapping=index_slot_mapping if full else None, q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight, index_q_norm_weight=index_q_norm_weight if full else None,
        index_k_norm_weight=index_k_norm_weight if full else None, k_cache=k_cache, v_cache=v_cache,
        index_cache=index_cache if full else None, k_scale=k_scale, v_scale=v_scale, q_out=q_out,
        index_q_out=index_q_out if full else None, num_heads=num_heads,
        num_index_heads=num_index_heads if full else 0, eps=float(eps))
    return variant, tensors


def check_ranges(v: Variant, t: Tensors) -> None:
    """The checked mode: every slot and position in range (reads them on the host)."""
    max_pos = t.cos_sin_cache.shape[0]
    bad = ((t.positions < 0) | (t.positions >= max_pos)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"positions: entry {i} is {int(t.positions[i])}, outside the cos_sin_cache "
                         f"rows [0, {max_pos})")
    checks = [("slot_mapping", t.slot_mapping, "k", t.k_cache), ("slot_mapping", t.slot_mapping, "v", t.v_cache)]
    if t.index_slot_mapping is not None:
        checks.append(("index_slot_mapping", t.index_slot_mapping, "index", t.index_cache))
    for name, slots, role, cache in checks:
        acc = access(v, role)
        capacity = cache.shape[acc.runtime_dim] * acc.page_size
        bad = (slots >= capacity).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"{name}: entry {i} is slot {int(slots[i])}, but the {role} cache holds "
                             f"{capacity} slots")
