"""SPEC §7: check every argument before any launch and derive the signature.

Each problem raises ValueError (a wrong value, shape, stride, device) or TypeError (a
wrong type or dtype) whose message reads `ARG: expected WHAT, got GIVEN`, or
`ARG: unsupported signature: AXIS: ...` naming what the axis allows (ARG: the argument
the axis is read from). Nothing here writes to any tensor. The result is the Variant to
dispatch to and the tensors the kernel (or the reference) consumes.

What is legal: 0 tokens (qkv [0, row]: the call computes and writes nothing); a
slot_mapping shorter than qkv, empty included (tokens past it write no cache); a 0-D
scale (per tensor). What is not: an empty cache, norm weight, cos_sin_cache or scale,
non-positive head counts, and any argument that means nothing for the call (a scale for
a model-dtype cache, index tensors in 'skip' or 'none' mode, index heads in 'none' mode,
kv_cache for a two-tensor contract, k_cache/v_cache for a one-tensor one). The arguments,
and which calls use each, are codegen/signature.py's table.
"""
from __future__ import annotations

import collections
import math
from typing import Optional

import torch

from kvforge.codegen.layout import VEC, access, page_size_from
from kvforge.codegen.model import SCALE_ROLES, IndexMode, IndexSlots, PointError, Variant, make_variant
from kvforge.codegen.signature import CALL_ARGS, CALL_NAMES, KERNEL_ARGS, Arg, Kind, Use

from .reference import FP8_DTYPES, Tensors
from .registry import spec

MODEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
COS_SIN_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP8_NAMES = {dt: f.value for f, dt in FP8_DTYPES.items()}
_SIGNATURES: dict[tuple, Variant] = {}  # derived axis values -> variant (make_variant once)


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _given(x) -> str:
    """What a message says was passed: a tensor's dtype and shape, else the value and its type."""
    if x is None:
        return "None"
    if isinstance(x, torch.Tensor):
        return f"a {_dt(x.dtype)} tensor of shape {_shape(x)}"
    text = repr(x)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(x).__name__})"


def _tensor(name: str, t, *, device: Optional[torch.device] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {_given(t)}")
    if t.layout is not torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where qkv is), got {t.device}")
    return t


def _present(name: str, t, why: str, device: torch.device) -> torch.Tensor:
    """An optional argument this call needs."""
    if t is None:
        raise ValueError(f"{name}: expected a tensor ({why}), got None")
    return _tensor(name, t, device=device)


def _absent(name: str, t, why: str) -> None:
    """SPEC §7: an argument that means nothing for the call is an error, not ignored."""
    if t is not None:
        raise ValueError(f"{name}: expected None ({why}), got {_given(t)}")


def _int(name: str, val, least: int, what: str) -> int:
    if isinstance(val, bool) or not isinstance(val, int):
        raise TypeError(f"{name}: expected {what}, got {_given(val)}")
    if val < least:
        raise ValueError(f"{name}: expected {what}, got {val}")
    return val


def _choice(name: str, val, enum):
    """An option (index_mode, norm, rope: a str naming an axis value) parsed into its enum."""
    if not isinstance(val, str):
        choices = ", ".join(repr(m.value) for m in enum)
        raise TypeError(f"{name}: expected one of {choices} (a str), got {_given(val)}")
    try:
        return enum.parse(val)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _dtype(name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        names = ", ".join(_dt(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}, got {_dt(t.dtype)}")


def _rank(name: str, t: torch.Tensor, rank: int, what: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor {what}, got shape {_shape(t)}")


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def _rows(name: str, t: torch.Tensor, row: int) -> None:
    """An output's rows ([T, heads, D] or [T, heads * D]): contiguous elements each, the row
    stride a multiple of 16 bytes and at least a row (a view of qkv's columns is one), and
    under 2^31 elements (the kernel's row offsets are products of 32-bit factors)."""
    inner = t.stride(-1) == 1 and (t.dim() == 2 or t.stride(1) == t.shape[2])
    stride = t.stride(0)
    if not inner or (t.shape[0] > 1 and ((stride * t.element_size()) % 16 or stride < row)):
        raise ValueError(f"{name}: expected rows of contiguous elements whose row stride is a multiple of 16 "
                         f"bytes, got strides {tuple(t.stride())}")
    if t.shape[0] > 1 and stride >= 2 ** 31:
        raise ValueError(f"{name}: expected a row stride under 2^31 elements, got {stride}")


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


def _head_dim(name: str, t, device, dtype) -> int:
    """A norm weight's size: its head_dim (1-D, at least one element, the dtype of qkv)."""
    _tensor(name, t, device=device)
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {_dt(dtype)} (the dtype of qkv), got {_dt(t.dtype)}")
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{name}: expected a 1-D tensor [head_dim] of at least one element, "
                         f"got shape {_shape(t)}")
    return t.numel()


def _weight(name: str, t, device, dtype, head_dim: int) -> torch.Tensor:
    if _head_dim(name, t, device, dtype) != head_dim:
        raise ValueError(f"{name}: expected shape ({head_dim},) (head_dim, the size of q_norm_weight), "
                         f"got {_shape(t)}")
    _contiguous(name, t)
    _aligned(name, t)
    return t


def _fp8_flavour(names_tensors) -> Optional[str]:
    """The FP8 flavour the FP8 tensors agree on (None if none is FP8); the first one sets it."""
    first = None
    for name, t in names_tensors:
        if t is None or t.dtype not in FP8_NAMES:
            continue
        if first is None:
            first = (name, t.dtype)
        elif t.dtype != first[1]:
            raise TypeError(f"{name}: expected dtype {_dt(first[1])} (the FP8 flavour of {first[0]}), "
                            f"got {_dt(t.dtype)}")
    return FP8_NAMES[first[1]] if first else None


def _scale_kind(name: str, t, device, nkv: int) -> str:
    if t is None:
        return "unit"
    _tensor(name, t, device=device)
    _dtype(name, t, (torch.float32,))
    if t.numel() == 1 and t.dim() <= 1:
        return "per_tensor"
    if t.dim() == 1 and t.numel() == nkv:
        _contiguous(name, t)
        return "per_head"
    raise ValueError(f"{name}: expected shape (1,) or () (per tensor) or ({nkv},) (per kv head), "
                     f"got {_shape(t)}")


def _cache(v: Variant, role: str, name: str, t: torch.Tensor) -> None:
    acc = access(v, role)
    shape = t.shape
    cache = getattr(v.contract, role)
    pages = cache.runtime_name
    if len(shape) != len(acc.extents) or any(e is not None and s != e for s, e in zip(shape, acc.extents)):
        expected = [pages if e is None else str(e) for e in acc.extents]
        sizes = ""
        if len(cache.page_sizes) > 1:
            sizes = f" (page size {acc.page_size}; the contract allows {', '.join(map(str, cache.page_sizes))})"
        raise ValueError(f"{name}: expected shape [{', '.join(expected)}] for contract "
                         f"{v.contract.name} with this signature{sizes}, got {_shape(t)}")
    if shape[acc.runtime_dim] < 1:
        raise ValueError(f"{name}: expected a cache of at least one page ({pages} >= 1), "
                         f"got shape {_shape(t)}")
    # A free stride of a data cache moves 16-byte vectors; a scale cache's, single values.
    unit = t.element_size() if role in SCALE_ROLES else 16
    for i, (size, stride, want) in enumerate(zip(t.shape, t.stride(), acc.contiguous_strides)):
        if want is None:
            if (stride * t.element_size()) % unit:
                raise ValueError(f"{name}: expected the stride of dimension {i} to be a multiple of {unit} "
                                 f"bytes, got strides {tuple(t.stride())}")
            inner = sum((n - 1) * st for n, st in zip(t.shape[i + 1:], t.stride()[i + 1:])) + 1
            if size > 1 and stride < inner:  # (a head-indexed free dim: heads must not overlap)
                raise ValueError(f"{name}: expected the stride of dimension {i} to span the dimensions after "
                                 f"it ({inner} elements), got strides {tuple(t.stride())}")
        elif size > 1 and stride != want:
            raise ValueError(f"{name}: expected stride {want} in dimension {i} (contiguous, as contract "
                             f"{v.contract.name} lays it out), got strides {tuple(t.stride())}")
    _aligned(name, t)


# The argument an axis of the signature is read from (an unsupported signature names it; the
# FP8 flavour is read from the KV cache, whichever argument holds it).
_AXIS_ARGUMENT = {a.axis: a.name for a in CALL_ARGS if a.axis}
_USED = {use: tuple(a for a in CALL_ARGS if a.use is use) for use in Use}
_CHOICES = tuple(a for a in CALL_ARGS if a.choices)  # options whose values are an axis's
_OUTPUTS = tuple(a for a in CALL_ARGS if a.kind is Kind.OUTPUT)
_NO_INDEX = {IndexMode.SKIP: "index_mode 'skip' reads and writes nothing index-related",
             IndexMode.NONE: "index_mode 'none' has no index branch"}
# The validated arguments by name; a call missing one or naming another is a TypeError.
_Call = collections.namedtuple("_Call", CALL_NAMES)


def _variant(contracts, point: dict, k_name: str) -> Variant:
    """The variant of a signature's axis values (made once per signature)."""
    key = tuple(point.values())
    variant = _SIGNATURES.get(key)
    if variant is None:
        try:
            variant = _SIGNATURES[key] = make_variant(contracts, point)
        except PointError as e:
            arg = (k_name if e.axis in ("fp8", "kv_page_size") else "index_cache" if e.axis == "index_page_size"
                   else "k_scale_cache" if e.axis == "kv_scale" and point["kv_scale"] == "per_token_head"
                   else _AXIS_ARGUMENT.get(e.axis, e.axis))
            raise ValueError(f"{arg}: unsupported signature: {e.axis}: {e}") from None
    return variant


def _required(use: Use) -> tuple[Arg, ...]:
    """The inputs and caches a call that has `use` must pass (outputs are checked last)."""
    return tuple(a for a in _USED[use] if not a.optional and a.kind is not Kind.OUTPUT)


def check(*, outputs: bool = True, **given) -> tuple[Variant, Tensors]:
    """Every argument of codegen/signature.py's CALL_ARGS checked, passed by name (with
    `outputs=False` all but the outputs: where the public function could not allocate them,
    which argument is to blame)."""
    a = _Call(**given)
    contracts = spec().contracts
    names = ", ".join(sorted(contracts))
    if not isinstance(a.contract, str):
        raise TypeError(f"contract: expected one of {names} (a str), got {_given(a.contract)}")
    if a.contract not in contracts:
        raise ValueError(f"contract: expected one of {names}, got {a.contract!r}")
    c = contracts[a.contract]
    choice = {x.name: _choice(x.name, getattr(a, x.name), x.choices) for x in _CHOICES}
    mode = choice["index_mode"]

    # Scalars first: the shapes below are read through them.
    num_heads, num_kv_heads, num_index_heads = a.num_heads, a.num_kv_heads, a.num_index_heads
    _int("num_heads", num_heads, 1, "a positive integer")
    _int("num_kv_heads", num_kv_heads, 1, "a positive integer")
    if mode is IndexMode.FULL:
        _int("num_index_heads", num_index_heads, 1, "a positive integer (index_mode 'full' has index heads)")
    elif mode is IndexMode.SKIP:
        _int("num_index_heads", num_index_heads, 0, "a non-negative integer")
    else:
        none = "0 (index_mode 'none': rows hold no index heads)"
        if _int("num_index_heads", num_index_heads, 0, none) != 0:
            raise ValueError(f"num_index_heads: expected {none}, got {num_index_heads}")
    rotary_dim, eps = a.rotary_dim, a.eps
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim: expected an even number in [2, head_dim], got {_given(rotary_dim)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a positive float, got {_given(eps)}")
    if not 0 < eps < math.inf:
        raise ValueError(f"eps: expected a positive finite float, got {eps!r}")

    qkv = _tensor("qkv", a.qkv)
    device = qkv.device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"qkv: expected a tensor on a GPU (cuda) or on the cpu, got {device}")
    _dtype("qkv", qkv, tuple(MODEL_DTYPES))
    _rank("qkv", qkv, 2, "[num_tokens, row]")
    if qkv.numel() and (qkv.stride(1) != 1 or qkv.stride(0) % VEC):  # (an empty one: its row says more)
        raise ValueError(f"qkv: expected rows of contiguous elements whose row stride is a multiple of "
                         f"{VEC}, got strides {tuple(qkv.stride())}")
    _aligned("qkv", qkv)
    T = qkv.shape[0]  # 0 is a legal call that computes and writes nothing

    # head_dim: the size of the q and k norm weights, whose heads fill the qkv row.
    q_norm_weight, k_norm_weight = a.q_norm_weight, a.k_norm_weight
    D = _head_dim("q_norm_weight", q_norm_weight, device, qkv.dtype)
    Dk = _head_dim("k_norm_weight", k_norm_weight, device, qkv.dtype)
    row_heads = num_heads + 2 * num_kv_heads + (num_index_heads + 1 if mode is not IndexMode.NONE else 0)
    if Dk != D:
        if qkv.shape[1] == row_heads * Dk != row_heads * D:
            raise ValueError(f"q_norm_weight: expected shape ({Dk},) (head_dim, the size of k_norm_weight, "
                             f"whose heads fill the qkv row), got {_shape(q_norm_weight)}")
        raise ValueError(f"k_norm_weight: expected shape ({D},) (head_dim, the size of q_norm_weight), "
                         f"got {_shape(k_norm_weight)}")
    if qkv.shape[1] != row_heads * D:
        parts = f"num_heads={num_heads} + 2*num_kv_heads={num_kv_heads}"
        if mode is not IndexMode.NONE:
            parts += f" + num_index_heads={num_index_heads} + 1 index_k head"
        raise ValueError(f"qkv: expected rows of {row_heads * D} elements ({parts} = {row_heads} heads of "
                         f"head_dim {D}, index_mode {mode.value}), got rows of {qkv.shape[1]}")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        _contiguous(name, w)
        _aligned(name, w)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > D:
        raise ValueError(f"rotary_dim: expected an even number in [2, head_dim={D}], got {rotary_dim}")

    positions = _tensor("positions", a.positions, device=device)
    _dtype("positions", positions, (torch.int64,))
    _rank("positions", positions, 1, "[num_tokens]")
    _contiguous("positions", positions)
    if positions.numel() != T:
        raise ValueError(f"positions: expected {T} entries (one per qkv row), got {positions.numel()}")
    cos_sin_cache = _tensor("cos_sin_cache", a.cos_sin_cache, device=device)
    _dtype("cos_sin_cache", cos_sin_cache, tuple(COS_SIN_DTYPES))
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache: expected shape [max_pos, rotary_dim={rotary_dim}], got {_shape(cos_sin_cache)}")
    if cos_sin_cache.shape[0] < 1:
        raise ValueError("cos_sin_cache: expected at least one row (position), got shape "
                         f"{_shape(cos_sin_cache)}")
    _contiguous("cos_sin_cache", cos_sin_cache)
    _aligned("cos_sin_cache", cos_sin_cache)
    slot_mapping = _slots("slot_mapping", a.slot_mapping, device, T)  # shorter: tokens past it write no cache

    # K/V caches: one combined tensor or two, as the contract says; the kernel gets K and V.
    if c.combined_kv:
        why, kept, dropped = f"contract {a.contract} stores K and V in one tensor", Use.KV_TOGETHER, Use.KV_APART
    else:
        why, kept, dropped = f"contract {a.contract} keeps K and V in two tensors", Use.KV_APART, Use.KV_TOGETHER
    instead = " and ".join(x.name for x in _USED[kept])
    for x in _USED[dropped]:
        _absent(x.name, getattr(a, x.name), f"{why}, {instead}")
    for x in _required(kept):
        _present(x.name, getattr(a, x.name), why, device)
    if c.combined_kv:
        k_cache = v_cache = a.kv_cache
        k_name = v_name = "kv_cache"
    else:
        k_cache, v_cache = a.k_cache, a.v_cache
        k_name, v_name = "k_cache", "v_cache"
    _dtype(k_name, k_cache, (qkv.dtype, *FP8_NAMES))
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: expected dtype {_dt(k_cache.dtype)} (the dtype of k_cache), "
                        f"got {_dt(v_cache.dtype)}")

    full = mode is IndexMode.FULL
    index_cache, index_slot_mapping, index_q_out = a.index_cache, a.index_slot_mapping, a.index_q_out
    if full:
        for x in _required(Use.INDEX):
            _present(x.name, getattr(a, x.name), "required with index_mode 'full'", device)
        _weight("index_q_norm_weight", a.index_q_norm_weight, device, qkv.dtype, D)
        _weight("index_k_norm_weight", a.index_k_norm_weight, device, qkv.dtype, D)
        _dtype("index_cache", index_cache, (qkv.dtype, *FP8_NAMES))
        if index_slot_mapping is None:
            if c.index_slots is IndexSlots.OWN:
                raise ValueError(f"index_slot_mapping: expected a tensor (contract {a.contract} has its own "
                                 f"index slots), got None")
            index_slot_mapping = slot_mapping
        _slots("index_slot_mapping", index_slot_mapping, device, T)
        if index_q_out is not None:
            _tensor("index_q_out", index_q_out, device=device)
            if index_q_out.dtype != index_cache.dtype:
                raise TypeError(f"index_q_out: expected dtype {_dt(index_cache.dtype)} (the dtype of "
                                f"index_cache), got {_dt(index_q_out.dtype)}")
    else:
        for x in _USED[Use.INDEX]:
            _absent(x.name, getattr(a, x.name), _NO_INDEX[mode])
    q_fp8_out = a.q_fp8_out
    q_fp8 = q_fp8_out is not None
    if q_fp8:
        _tensor("q_fp8_out", q_fp8_out, device=device)
        _dtype("q_fp8_out", q_fp8_out, tuple(FP8_NAMES))
        q_fp8_scale = _present("q_fp8_scale", a.q_fp8_scale, "the scale of q_fp8_out", device)
        _dtype("q_fp8_scale", q_fp8_scale, (torch.float32,))
        if q_fp8_scale.numel() != 1 or q_fp8_scale.dim() > 1:
            raise ValueError(f"q_fp8_scale: expected shape (1,) or () (a device scalar), got {_shape(q_fp8_scale)}")
    else:
        _absent("q_fp8_scale", a.q_fp8_scale, "q_fp8_out is None: there is no FP8 query output")
    fp8 = _fp8_flavour([(k_name, k_cache), ("index_cache", index_cache), ("q_fp8_out", q_fp8_out)])
    dynamic = a.k_scale_cache is not None or a.v_scale_cache is not None
    if k_cache.dtype in FP8_NAMES and dynamic:
        for x in _USED[Use.KV_DYNAMIC]:
            _present(x.name, getattr(a, x.name), "per-token scales are written to both scale caches", device)
            _dtype(x.name, getattr(a, x.name), (torch.float32,))
        for x in _USED[Use.KV_FP8]:
            _absent(x.name, getattr(a, x.name), "per-token scales (k_scale_cache, v_scale_cache) are computed "
                                                "by the kernel, not given")
        kv_scale = "per_token_head"
    elif k_cache.dtype in FP8_NAMES:
        ks = _scale_kind("k_scale", a.k_scale, device, num_kv_heads)
        vs = _scale_kind("v_scale", a.v_scale, device, num_kv_heads)
        if ks != vs:
            raise ValueError(f"v_scale: expected the granularity of k_scale ({ks}), got {vs}")
        kv_scale = ks
    else:
        for x in (*_USED[Use.KV_FP8], *_USED[Use.KV_DYNAMIC]):
            _absent(x.name, getattr(a, x.name), f"{k_name} is {_dt(k_cache.dtype)}: a model-dtype cache takes no scale")
        kv_scale = "none"

    point = {
        "dtype": MODEL_DTYPES[qkv.dtype], "head_dim": D, "rotary_dim": rotary_dim, "num_kv_heads": num_kv_heads,
        "cos_sin": COS_SIN_DTYPES[cos_sin_cache.dtype], "contract": a.contract,
        **{x.axis: choice[x.name].value for x in _CHOICES},
        "index_dtype": "fp8" if full and index_cache.dtype in FP8_NAMES else "model",
        "kv_scale": kv_scale, "fp8": fp8 or "e4m3fn", "q_fp8": "per_tensor" if q_fp8 else "none",
        "kv_page_size": "contract", "index_page_size": "contract",
    }
    variant = _variant(contracts, point, k_name)
    # The page sizes, read from the caches' shapes (an unrecognised shape keeps the default, whose
    # shape the cache's check then names).
    read = {"kv_page_size": page_size_from(variant, "k", tuple(k_cache.shape))}
    if full:
        read["index_page_size"] = page_size_from(variant, "index", tuple(index_cache.shape))
    read = {axis: size for axis, size in read.items() if size is not None and size != getattr(variant, axis)}
    if read:
        variant = _variant(contracts, {**point, **read}, k_name)

    _cache(variant, "k", k_name, k_cache)
    if not c.combined_kv:
        _cache(variant, "v", v_name, v_cache)
    if full:
        _cache(variant, "index", "index_cache", index_cache)
    if kv_scale == "per_token_head":
        _cache(variant, "k_scale", "k_scale_cache", a.k_scale_cache)
        _cache(variant, "v_scale", "v_scale_cache", a.v_scale_cache)
    # What each output holds: its heads and dtype.
    held = {"q_out": (num_heads, qkv.dtype), "index_q_out": (num_index_heads, index_cache.dtype if full else None),
            "q_fp8_out": (num_heads, q_fp8_out.dtype if q_fp8 else None), "k_out": (num_kv_heads, qkv.dtype),
            "index_k_out": (1, qkv.dtype)}
    used = {Use.ALWAYS: True, Use.INDEX: full, Use.Q_FP8: q_fp8}  # (the uses an output has)
    for x in _OUTPUTS if outputs else ():
        out = getattr(a, x.name)
        if not used[x.use]:
            continue
        if out is None and x.optional and (x.name != "q_out" or q_fp8):  # q_fp8_out may stand instead of q_out
            continue
        if out is None:
            # the public function allocates it; the op itself (torch.ops) needs it passed
            raise ValueError(f"{x.name}: expected a tensor (an output the kernel writes; "
                             f"fused_qknorm_rope_cache allocates it when not passed), got None")
        heads, dtype = held[x.name]
        _tensor(x.name, out, device=device)
        _dtype(x.name, out, (dtype,))
        if out.shape not in ((T, heads, D), (T, heads * D)):
            raise ValueError(f"{x.name}: expected shape ({T}, {heads}, {D}) or ({T}, {heads * D}), "
                             f"got {_shape(out)}")
        _rows(x.name, out, heads * D)
        _aligned(x.name, out)
    # The kernel's tensors: kv_cache as K and V, the index slots shared where the contract
    # says so, no index heads outside index_mode 'full'.
    tensors = Tensors(**{**{x.name: getattr(a, x.name) for x in KERNEL_ARGS},
                         "k_cache": k_cache, "v_cache": v_cache, "index_slot_mapping": index_slot_mapping,
                         "num_index_heads": num_index_heads if full else 0, "eps": float(eps)})
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
    if t.k_scale_cache is not None:
        checks += [("slot_mapping", t.slot_mapping, "k_scale", t.k_scale_cache),
                   ("slot_mapping", t.slot_mapping, "v_scale", t.v_scale_cache)]
    if t.index_slot_mapping is not None:
        checks.append(("index_slot_mapping", t.index_slot_mapping, "index", t.index_cache))
    for name, slots, role, cache in checks:
        acc = access(v, role)
        capacity = acc.capacity(cache.shape)
        bad = (slots >= capacity).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"{name}: entry {i} is slot {int(slots[i])}, but the {role} cache holds "
                             f"{capacity} slots")
