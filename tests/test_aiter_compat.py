"""AITER's own unit tests, re-expressed through kvforge's AITER drop-ins (runtime/aiter_compat.py).

Sources: PR #4813's op_tests/test_minimax_m3_fused_qknorm_rope_cache_shuffle.py (for
`minimax_m3_qknorm_rope_cache_shuffle_insert`) and main's / PR #5143's
op_tests/test_fused_qknorm_idxrqknorm.py (for `fused_qknorm_idxrqknorm`: DEFAULT_CASES, the
focused TP4 cases, the packed LBHNC cases, the FP8 index_q cases). Their shapes, page sizes,
defaults and input construction are kept (drawn from a seeded CPU generator instead of CUDA's
global one), and so are their checks, at their tolerances, against their unfused fp32 oracle.
Besides:
* every call is bit-identical to direct `fused_qknorm_rope_cache` calls this file spells out;
* every byte the call may not write keeps its value (cache addresses from the contracts' own
  index expressions: tests/layout_oracle.py), as do qkv's slices AITER leaves alone;
* per-token FP8 scales and values match AITER's definition computed here from the unfused fp32
  oracle, at SPEC §6's oracle bar.

Two tiers. CPU (unmarked, in CI): the API runs its torch reference on CPU tensors. GPU (`gpu`):
every case on CUDA tensors, outputs and caches poisoned, against the reference at SPEC §6's bar
(testing.compare: <= 1 ulp, >= 99% bit-identical, every unaddressed byte untouched), after a
module fixture has built every variant the cases need in parallel.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from typing import Callable, Optional

import pytest
import torch

import layout_oracle

from kvforge.codegen.signature import CALL_NAMES
from kvforge.runtime import aiter_compat, build, engine_args, toolchain
from kvforge.runtime.aiter_compat import fused_qknorm_idxrqknorm, minimax_m3_qknorm_rope_cache_shuffle_insert
from kvforge.runtime.api import fused_qknorm_rope_cache, reference_qknorm_rope_cache
from kvforge.runtime.registry import source_of
from kvforge.runtime.testing import compare
from kvforge.runtime.validate import check

D = 128        # AITER's HEAD_DIM
EPS = 1e-6
BF16, FP16 = torch.bfloat16, torch.float16
FP8 = engine_args.platform_fp8(torch.device("cpu"))  # what uint8 caches are read as off gfx942
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FORM = re.compile(r"^(?P<arg>[a-z_0-9]+): expected .+, got .+", re.S)


# ---- AITER's unfused oracle (norm_rope_ref of both test files) -------------------------------
def gemma_rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())


def neox(x: torch.Tensor, cs: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Partial NeoX RoPE of x [T, H, D] with the cos/sin rows cs [T, R], multiply then add."""
    half = rotary_dim // 2
    c, s = cs[:, None, :half].float(), cs[:, None, half:rotary_dim].float()
    out = x.clone()
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    out[..., :half] = x1 * c - x2 * s
    out[..., half:rotary_dim] = x2 * c + x1 * s
    return out


def norm_rope(x, w, positions, cos_sin, rotary_dim) -> torch.Tensor:
    """fp32 [T, H, D]."""
    return neox(gemma_rmsnorm(x, w), cos_sin[positions], rotary_dim)


def cancelled(x, w, positions, cos_sin, rotary_dim) -> torch.Tensor:
    """SPEC §6's M per element of norm_rope: |n_i c_i| + |n_{i+h} s_i| (dims past R: |n_i|)."""
    n = gemma_rmsnorm(x, w)
    half = rotary_dim // 2
    cs = cos_sin[positions]
    c, s = cs[:, None, :half].float().abs(), cs[:, None, half:rotary_dim].float().abs()
    m = n.abs().clone()
    n1, n2 = n[..., :half].abs(), n[..., half:rotary_dim].abs()
    m[..., :half] = n1 * c + n2 * s
    m[..., half:rotary_dim] = n2 * c + n1 * s
    return m


def close(actual, expected, msg: str, rtol: float, atol: float) -> None:
    """AITER's check_close: checkAllclose returning 0 (every element isclose)."""
    a, e = actual.float(), expected.float()
    ok = torch.isclose(a, e, rtol=rtol, atol=atol)
    if not bool(ok.all()):
        worst = float((a - e).abs().max())
        raise AssertionError(f"{msg}: {int((~ok).sum())} of {ok.numel()} elements outside rtol={rtol}, "
                             f"atol={atol} (max |diff| {worst:.4g})")


def fp8_view(t: torch.Tensor, fp8=FP8) -> torch.Tensor:
    """AITER's maybe_view_fp8."""
    return t.view(fp8) if t.dtype == torch.uint8 else t


def fp8_codes(t: torch.Tensor) -> torch.Tensor:
    """FP8 codes as integers that step by one per representable value."""
    b = t.view(torch.uint8).to(torch.int16)
    return torch.where(b >= 0x80, -(b & 0x7F), b)


class _Addresses:
    """Stands for a cache in layout_oracle.read (which takes x from its element size): indexes
    the storage positions of the cache's elements instead of their values."""

    def __init__(self, index: torch.Tensor, element_size: int):
        self._index, self._size = index, element_size

    def element_size(self) -> int:
        return self._size

    def __getitem__(self, index):
        return self._index[index]


@functools.lru_cache(maxsize=None)
def _positions(contract, role, shape, stride, offset, size, slot, nkv, page_size) -> torch.Tensor:
    span = offset + sum((n - 1) * st for n, st in zip(shape, stride)) + 1
    index = torch.arange(span).as_strided(shape, stride, offset)
    return layout_oracle.read(contract, role, _Addresses(index, size), slot, nkv, D, page_size)


def at(contract, role, cache, slot, nkv, page_size=None) -> torch.Tensor:
    """Storage positions [heads, D] (D = 1 for a scale cache) of what `cache` holds for `slot`,
    from the contract's index expressions as the variants file spells them (tests/layout_oracle.py)."""
    return _positions(contract, role, tuple(cache.shape), tuple(cache.stride()), cache.storage_offset(),
                      cache.element_size(), slot, nkv, page_size)


def _storage(t: torch.Tensor) -> torch.Tensor:
    """t's whole allocation, flat, in t's dtype (a view)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))


def read(contract, role, cache, slot, nkv, head_dim=D, page_size=None) -> torch.Tensor:
    """layout_oracle.read: [heads, D] stored for `slot` (its addresses computed once per layout)."""
    assert head_dim == D
    return _storage(cache)[at(contract, role, cache, slot, nkv, page_size)]


def storage_bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of t's whole allocation as integers of its element size."""
    return _storage(t).view(_BITS[t.element_size()]).clone()


def addresses(contract, role, cache, slots, nkv, page_size=None) -> torch.Tensor:
    """Storage positions of the elements `cache` holds for the valid `slots`."""
    found = [at(contract, role, cache, s, nkv, page_size).flatten() for s in slots if s >= 0]
    return torch.cat(found) if found else torch.empty(0, dtype=torch.long)


def assert_only_at(name: str, before: torch.Tensor, t: torch.Tensor, positions: torch.Tensor) -> None:
    """Every element of t's allocation but those at `positions` as in the `before` snapshot."""
    after = storage_bits(t)
    keep = torch.ones(after.numel(), dtype=torch.bool)
    keep[positions] = False
    bad = keep & (after != before)
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements written outside the addressed slots"


def assert_kv_only_at(contract, kw, before, slots, nkv, page_size=None) -> None:
    """K and V (kv_cache_k/kv_cache_v, or k_cache/v_cache) written at the slots only; where they
    are views of one allocation, at the slots of either."""
    k_key, v_key = ("kv_cache_k", "kv_cache_v") if "kv_cache_k" in kw else ("k_cache", "v_cache")
    k, v = kw[k_key], kw[v_key]
    at = {key: addresses(contract, role, t, slots, nkv, page_size) for key, role, t in ((k_key, "k", k), (v_key, "v", v))}
    if k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
        assert_only_at(f"{k_key}/{v_key}", before[k_key], k, torch.cat(list(at.values())))
    else:
        for key, t in ((k_key, k), (v_key, v)):
            assert_only_at(key, before[key], t, at[key])


def same_bytes(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(storage_bits(got), storage_bits(want)), f"{name}: not bit-identical to the direct call"


def clone_args(kw: dict, device="cpu", invert=frozenset()) -> dict:
    """kw with every tensor a copy on `device` of its whole allocation (views of one allocation
    stay views of one copy); the allocations of the names in `invert` bitwise complemented."""
    copies, out = {}, {}
    for key, t in kw.items():
        if not isinstance(t, torch.Tensor):
            out[key] = t
            continue
        base = t if t._base is None else t._base
        if id(base) not in copies:
            copies[id(base)] = base.detach().to(device, copy=True)
            if key in invert:
                copies[id(base)].view(torch.uint8).bitwise_not_()
        c = copies[id(base)]
        if c.dtype != t.dtype:
            c = c.view(t.dtype)
        out[key] = c.as_strided(t.size(), t.stride(), t.storage_offset())
    return out


@dataclasses.dataclass
class Call:
    """One call of a drop-in: the op, its arguments by name, the arguments it may write
    (outputs, caches, per-token scales; qkv aside, which some modes write in place), and
    tensors the test holds beside them (an output not passed, the allocation views come from)."""

    op: Callable
    kw: dict
    writes: tuple
    held: dict = dataclasses.field(default_factory=dict)

    def run(self, kw: Optional[dict] = None) -> None:
        self.op(**(self.kw if kw is None else kw))


# ---- #5143 / main: make_case and its references -------------------------------------------------
@dataclasses.dataclass
class Case:
    dtype: torch.dtype
    qkv: torch.Tensor
    q_w: torch.Tensor
    k_w: torch.Tensor
    iq_w: Optional[torch.Tensor]
    ik_w: Optional[torch.Tensor]
    cos_sin: torch.Tensor
    positions: torch.Tensor
    nq: int
    nkv: int
    niq: int
    rotary_dim: int
    block_size: int
    num_blocks: int
    slot_mapping: torch.Tensor
    index_slot_mapping: torch.Tensor

    def split(self, qkv: torch.Tensor):
        """q, k, v, index_q, index_k column slices (AITER's split_qkv)."""
        sizes = [self.nq * D, self.nkv * D, self.nkv * D] + ([self.niq * D, D] if self.niq else [])
        return qkv.split(sizes, dim=-1)

    @functools.cached_property
    def refs(self) -> dict:
        """AITER's make_refs (rounded to the dtype), plus the fp32 values and their M."""
        T = self.qkv.shape[0]
        parts = self.split(self.qkv)
        heads = lambda x, h: x.reshape(T, h, D)  # noqa: E731
        args = (self.positions, self.cos_sin, self.rotary_dim)
        k32 = norm_rope(heads(parts[1], self.nkv), self.k_w, *args)
        out = {"q": norm_rope(heads(parts[0], self.nq), self.q_w, *args).to(self.dtype).reshape(T, -1),
               "k32": k32, "k": k32.to(self.dtype), "k_m": cancelled(heads(parts[1], self.nkv), self.k_w, *args),
               "v": heads(parts[2], self.nkv)}
        if self.niq:
            iq32 = norm_rope(heads(parts[3], self.niq), self.iq_w, *args)
            out.update(iq32=iq32.reshape(T, -1), index_q=iq32.to(self.dtype).reshape(T, -1),
                       index_k=norm_rope(heads(parts[4], 1), self.ik_w, *args).to(self.dtype).reshape(T, D))
        return out


@functools.lru_cache(maxsize=None)
def rope_table(rotary_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """make_cos_sin_cache: real frequencies, base 5e6, 4096 positions (read-only: shared)."""
    inv_freq = 1.0 / (5_000_000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def make_case(dtype, num_tokens, block_size=16, num_heads=16, num_kv_heads=4, num_index_heads=4,
              rotary_dim=64, seed=123) -> Case:
    g = torch.Generator().manual_seed(seed)
    weight = lambda: torch.randn(D, generator=g).to(dtype) * 0.1  # noqa: E731
    q_w, k_w = weight(), weight()
    iq_w = weight() if num_index_heads > 0 else None
    ik_w = weight() if num_index_heads > 0 else None
    cos_sin = rope_table(rotary_dim, dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    row = (num_heads + 2 * num_kv_heads + (num_index_heads + 1 if num_index_heads > 0 else 0)) * D
    qkv = torch.randn(num_tokens, row, generator=g).to(dtype)
    num_blocks = (num_tokens + block_size - 1) // block_size + 1
    slot_mapping = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    index_slot_mapping = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    return Case(dtype, qkv, q_w, k_w, iq_w, ik_w, cos_sin, positions, num_heads, num_kv_heads, num_index_heads,
                rotary_dim, block_size, num_blocks, slot_mapping, index_slot_mapping)


def shuffle_caches(nb: int, nkv: int, bs: int, dtype, fill: float = 0.0):
    """make_shuffle_caches: K [nb, nkv, D/x, bs, x], V [nb, nkv, bs/x, D, x]."""
    x = 16 // torch.empty((), dtype=dtype).element_size()
    return (torch.full((nb, nkv, D // x, bs, x), fill).to(dtype),
            torch.full((nb, nkv, bs // x, D, x), fill).to(dtype))


def base_kw(case: Case, qkv: torch.Tensor) -> dict:
    """fused_qknorm_idxrqknorm's leading arguments for a case (its positional ones)."""
    return dict(qkv=qkv, q_norm_weight=case.q_w, k_norm_weight=case.k_w, cos_sin_cache=case.cos_sin,
                positions=case.positions, num_heads=case.nq, num_kv_heads=case.nkv, rotary_dim=case.rotary_dim,
                eps=EPS, index_q_norm_weight=case.iq_w, index_k_norm_weight=case.ik_w,
                num_index_heads=case.niq)


def native_common(kw: dict, index: bool) -> dict:
    """The arguments a direct fused_qknorm_rope_cache call shares with the drop-in's."""
    out = dict(q_norm_weight=kw["q_norm_weight"], k_norm_weight=kw["k_norm_weight"], num_heads=kw["num_heads"],
               num_kv_heads=kw["num_kv_heads"], rotary_dim=kw["rotary_dim"], eps=kw["eps"],
               num_index_heads=kw["num_index_heads"])
    if index:
        out.update(index_q_norm_weight=kw["index_q_norm_weight"], index_k_norm_weight=kw["index_k_norm_weight"])
    return out


# ---- fused_qknorm_idxrqknorm: DEFAULT_CASES (main and #5143) ----------------------------------
# (mode, dtype, num_tokens, block_size, rotary_dim, num_index_heads); nq 16, nkv 4 throughout.
DEFAULT_CASES = [
    ("insert", BF16, 1, 16, 64, 4), ("insert", BF16, 17, 16, 64, 4), ("insert", BF16, 19, 16, 96, 4),
    ("insert", FP16, 33, 8, 128, 4),
    ("dense_insert", BF16, 13, 8, 96, 0),
    ("slot_mapping_fallback", BF16, 9, 8, 64, 4),
    ("inplace", BF16, 11, 16, 64, 0), ("inplace", BF16, 11, 16, 64, 4), ("inplace", FP16, 11, 16, 64, 4),
    ("asm_layout", BF16, 17, 16, 64, 4), ("asm_layout", FP16, 19, 16, 96, 4), ("asm_layout", BF16, 13, 16, 64, 0),
    ("asm_layout_fp8_index", BF16, 17, 16, 64, 4),
    # SGLang contract: page-1 NHD, unit-scale FP8 K/V, model-dtype index cache.
    ("fp8_kv_cache_unit", BF16, 1, 1, 64, 1), ("fp8_kv_cache_unit", BF16, 16, 1, 64, 1),
    ("fp8_kv_cache_unit", BF16, 64, 1, 64, 1),
    # ATOM contract: per-token FP8 K/V scales, FP8 index cache.
    ("fp8_kv_cache_pertoken", BF16, 17, 16, 64, 4), ("fp8_kv_cache_pertoken_uint8", BF16, 17, 16, 64, 4),
    ("asm_layout_fp8_pertoken", BF16, 17, 16, 64, 4), ("asm_layout_fp8_pertoken", FP16, 19, 16, 96, 4),
    ("asm_layout_fp8_pertoken_uint8", BF16, 17, 16, 64, 4),
]


def default_id(c) -> str:
    mode, dtype, T, bs, R, niq = c
    return f"{mode}-{str(dtype).removeprefix('torch.')}-t{T}-bs{bs}-r{R}-iq{niq}"


@dataclasses.dataclass
class Mode:
    """What an AITER test mode selects (run_fused_qknorm_idxrqknorm)."""

    name: str

    @property
    def asm(self) -> bool:
        return self.name.startswith("asm_layout")

    @property
    def fp8_kv(self) -> bool:
        return self.name.startswith("fp8_kv_cache") or (self.name.startswith("asm_layout_fp8")
                                                         and self.name != "asm_layout_fp8_index")

    @property
    def unit(self) -> bool:
        return self.name == "fp8_kv_cache_unit"

    @property
    def per_token(self) -> bool:
        return "pertoken" in self.name

    @property
    def uint8(self) -> bool:
        return self.name.endswith("_uint8")

    @property
    def fp8_index(self) -> bool:
        return (self.fp8_kv and not self.unit) or self.name == "asm_layout_fp8_index"

    @property
    def contract(self) -> str:
        return "vllm_shuffle16" if self.asm else "aiter_nhd"


def default_call(mode_name, dtype, T, bs, R, niq, fp8=FP8) -> tuple[Call, Case]:
    """A DEFAULT_CASES row as run_fused_qknorm_idxrqknorm makes it (NaN-filled where AITER
    allocates with torch.empty: what the call leaves unwritten shows)."""
    mode = Mode(mode_name)
    case = make_case(dtype, T, bs, num_index_heads=niq, rotary_dim=R)
    kw = base_kw(case, case.qkv.clone())
    if mode.name == "inplace":
        return Call(fused_qknorm_idxrqknorm, kw, ()), case
    kv_dtype = (torch.uint8 if mode.uint8 else fp8) if mode.fp8_kv else dtype
    nan = float("nan")
    q_out = torch.full((T, case.nq * D), nan, dtype=dtype)
    index_q_out = torch.full((T, niq * D), nan, dtype=dtype)
    index_cache = torch.zeros(case.num_blocks, bs, D, dtype=fp8 if mode.fp8_index else dtype)
    if mode.asm:
        k_cache, v_cache = shuffle_caches(case.num_blocks, case.nkv, bs, kv_dtype)
    else:  # page-128: the K and V views of one [num_blocks, 2, block_size, nkv, D] cache
        kv = torch.zeros(case.num_blocks, 2, bs, case.nkv, D, dtype=kv_dtype)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    index_slot_mapping = case.index_slot_mapping if mode.name != "slot_mapping_fallback" else None
    if niq == 0:
        index_q_out = index_cache = index_slot_mapping = None
    k_scale = v_scale = None
    kv_cache_dtype = "auto"
    if mode.unit:
        kv_cache_dtype = "fp8_e4m3_unit"
    elif mode.fp8_kv:  # per-token: scales the op writes
        shape = (case.num_blocks, case.nkv, bs) if mode.asm else (case.nkv, case.num_blocks * bs)
        k_scale, v_scale = torch.zeros(shape), torch.zeros(shape)
        kv_cache_dtype = "fp8_e4m3"
    kw.update(slot_mapping=case.slot_mapping, kv_cache_k=k_cache, kv_cache_v=v_cache, index_cache=index_cache,
              block_size=bs, q_out=q_out, index_q_out=index_q_out, index_slot_mapping=index_slot_mapping,
              kv_cache_dtype=kv_cache_dtype, index_cache_dtype="fp8" if mode.fp8_index else "auto",
              k_scale=k_scale, v_scale=v_scale, asm_layout=mode.asm)
    writes = ("q_out", "index_q_out", "kv_cache_k", "kv_cache_v", "index_cache") + (
        ("k_scale", "v_scale") if mode.per_token else ())
    return Call(fused_qknorm_idxrqknorm, kw, writes), case


def inplace_direct(kw: dict, case: Case) -> torch.Tensor:
    """qkv as a direct call computes AITER's non-insert mode: q, K, index_q and index_k into
    outputs of their own (dummy caches that no slot addresses), written over a copy of qkv."""
    T, nkv = case.qkv.shape[0], case.nkv
    index = case.niq > 0
    no_slots = torch.empty(0, dtype=torch.int64)
    outs = {"q_out": torch.empty(T, case.nq, D, dtype=case.dtype), "k_out": torch.empty(T, nkv, D, dtype=case.dtype)}
    if index:
        outs.update(index_q_out=torch.empty(T, case.niq, D, dtype=case.dtype),
                    index_k_out=torch.empty(T, 1, D, dtype=case.dtype),
                    index_cache=torch.zeros(1, 16, D, dtype=case.dtype), index_slot_mapping=no_slots)
    fused_qknorm_rope_cache(
        case.qkv, case.positions, case.cos_sin, no_slots, torch.zeros(1, 16, nkv, D, dtype=case.dtype),
        torch.zeros(1, 16, nkv, D, dtype=case.dtype), contract="aiter_nhd",
        index_mode="full" if index else "none", **native_common(kw, index), **outs)
    want = case.qkv.clone()
    parts = case.split(want)
    parts[0].copy_(outs["q_out"].view(T, -1))
    parts[1].copy_(outs["k_out"].view(T, -1))
    if index:
        parts[3].copy_(outs["index_q_out"].view(T, -1))
        parts[4].copy_(outs["index_k_out"].view(T, -1))
    return want


def insert_direct(kw: dict, contract: str, fp8=FP8) -> dict:
    """A copy of the drop-in's arguments with its insert-mode writes done by direct calls:
    the layout's contract, typed FP8 caches, per-token scales as scale caches, unit scale as
    no scale (a per-tensor 1.0 on SHUFFLE), index slots defaulting to the KV slots. An
    index_q_out of another dtype than the FP8 index cache takes a second call, which rewrites
    every cache with the same bytes and index_k into a model-dtype index cache of its own."""
    n = clone_args(kw)
    index = n["num_index_heads"] > 0 and not n.get("skip_index_branch")
    k, v = fp8_view(n["kv_cache_k"], fp8), fp8_view(n["kv_cache_v"], fp8)
    scales = {}
    if n["kv_cache_dtype"] in ("fp8", "fp8_e4m3"):
        scales = dict(k_scale_cache=n["k_scale"], v_scale_cache=n["v_scale"])
    elif n["kv_cache_dtype"] == "fp8_e4m3_static":
        scales = dict(k_scale=n["k_scale"], v_scale=n["v_scale"])
    elif n["kv_cache_dtype"] == "fp8_e4m3_unit" and contract == "vllm_shuffle16":
        scales = dict(k_scale=torch.ones(1), v_scale=torch.ones(1))
    q_out = n["q_out"] if n["q_out"] is not None else n["qkv"][:, :n["num_heads"] * D]
    call = dict(contract=contract, q_out=q_out, index_mode="full" if index else "skip" if n["num_index_heads"]
                else "none", **scales, **native_common(n, index))
    if not index:
        fused_qknorm_rope_cache(n["qkv"], n["positions"], n["cos_sin_cache"], n["slot_mapping"], k, v, **call)
        return n
    index_cache = fp8_view(n["index_cache"], fp8)
    islots = n["index_slot_mapping"] if n["index_slot_mapping"] is not None else n["slot_mapping"]
    iq = n["index_q_out"]
    if iq is None:
        start = (n["num_heads"] + 2 * n["num_kv_heads"]) * D
        iq = n["qkv"][:, start:start + n["num_index_heads"] * D]
    one_call = iq.dtype == index_cache.dtype
    fused_qknorm_rope_cache(n["qkv"], n["positions"], n["cos_sin_cache"], n["slot_mapping"], k, v,
                            index_cache=index_cache, index_slot_mapping=islots,
                            index_q_out=iq if one_call else None, **call)
    if not one_call:
        fused_qknorm_rope_cache(n["qkv"], n["positions"], n["cos_sin_cache"], n["slot_mapping"], k, v,
                                index_cache=torch.zeros(index_cache.shape, dtype=iq.dtype), index_slot_mapping=islots,
                                index_q_out=iq, **call)
    return n


def check_pertoken(case: Case, kw: dict, contract: str, fp8=FP8) -> None:
    """AITER's check_pertoken_fp8 (scales within 1e-3, dequantized rows within 0.1 of
    fp8(x / s) * s, cosine > 0.99), then SPEC §6 against AITER's definition computed here:
    scale = amax(fp32 K) / fp8 max (1 for 0) within 1 ulp + 2^-20 M / fp8 max; stored values
    fp8(bf16(K) / scale) within one FP8 code; V's scales exactly amax(V) / fp8 max."""
    refs, bs, nkv = case.refs, case.block_size, case.nkv
    fmax = torch.finfo(fp8).max
    ps = None if contract == "vllm_shuffle16" else bs
    cos_min = 1.0
    for token, slot in enumerate(case.slot_mapping.tolist()):
        k_s = read(contract, "k_scale", kw["k_scale"], slot, nkv, D, bs).view(nkv, 1)
        v_s = read(contract, "v_scale", kw["v_scale"], slot, nkv, D, bs).view(nkv, 1)
        k_raw = fp8_view(read(contract, "k", kw["kv_cache_k"], slot, nkv, D, ps), fp8)
        v_raw = fp8_view(read(contract, "v", kw["kv_cache_v"], slot, nkv, D, ps), fp8)
        for x, s, raw, name in ((refs["k"][token], k_s, k_raw, "k"), (refs["v"][token], v_s, v_raw, "v")):
            amax = x.float().abs().amax(-1, keepdim=True)  # AITER's pertoken_quant_ref, on the rounded K
            s_ref = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
            close(s, s_ref, f"{name}_scale token {token}", rtol=1e-3, atol=1e-3)
            deq = raw.float() * s
            close(deq, (x.float() / s_ref).to(fp8).float() * s_ref, f"{name}_cache token {token}", rtol=0.1, atol=0.1)
            cos = torch.nn.functional.cosine_similarity(deq, x.float(), dim=-1)
            cos_min = min(cos_min, float(cos.min()))
        # SPEC §6 against AITER's kernel definition (amax of the fp32 K, values from the rounded K).
        k32, m = refs["k32"][token], refs["k_m"][token]
        amax = k32.abs().amax(-1, keepdim=True)
        s_def = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        ulp = lambda t: torch.nextafter(t.abs(), torch.tensor(math.inf)) - t.abs()  # noqa: E731
        bound = (ulp(amax) + 2.0 ** -20 * m.amax(-1, keepdim=True)) / fmax + ulp(s_def)
        assert bool(((k_s - s_def).abs() <= bound).all()), f"k_scale token {token}: {k_s.flatten()} vs {s_def.flatten()}"
        k_def = (k32.to(case.dtype).float() / s_def).to(fp8)
        assert int((fp8_codes(k_raw) - fp8_codes(k_def)).abs().max()) <= 1, f"k_cache token {token}"
        v32 = refs["v"][token].float()
        vmax = v32.abs().amax(-1, keepdim=True)
        v_def = torch.where(vmax > 0, vmax / fmax, torch.ones_like(vmax))
        assert torch.equal(v_s, v_def), f"v_scale token {token}"
        assert int((fp8_codes(v_raw) - fp8_codes((v32 / v_def).to(fp8))).abs().max()) <= 1, f"v_cache token {token}"
    assert cos_min > 0.99, f"per-token FP8 cosine too low: {cos_min}"


@pytest.mark.parametrize("mode,dtype,T,bs,R,niq", DEFAULT_CASES, ids=[default_id(c) for c in DEFAULT_CASES])
def test_default_case(mode, dtype, T, bs, R, niq):
    call, case = default_call(mode, dtype, T, bs, R, niq)
    kw, m = call.kw, Mode(mode)
    before = {k: storage_bits(kw[k]) for k in call.writes if kw[k] is not None}
    refs = case.refs
    if m.name == "inplace":
        want = inplace_direct(kw, case)
        call.run()
        same_bytes("qkv", kw["qkv"], want)
        q, k, v, *index = case.split(kw["qkv"])
        close(q, refs["q"], "q", rtol=1e-2, atol=1e-2)
        close(k.reshape(T, case.nkv, D), refs["k"], "k", rtol=1e-2, atol=1e-2)
        assert torch.equal(v, case.split(case.qkv)[2]), "V was written in place"
        if niq:
            close(index[0], refs["index_q"], "index_q", rtol=1e-2, atol=1e-2)
            close(index[1], refs["index_k"], "index_k", rtol=1e-2, atol=1e-2)
        return

    want = insert_direct(kw, m.contract)
    call.run()
    for key in ("qkv", *call.writes):
        if kw[key] is not None:
            same_bytes(key, kw[key], want[key])
    assert torch.equal(kw["qkv"], case.qkv), "qkv was written (insert mode writes K and index_k only to caches)"
    close(kw["q_out"], refs["q"], "q_out", rtol=1e-2, atol=1e-2)
    if niq:
        close(kw["index_q_out"], refs["index_q"], "index_q_out", rtol=1e-2, atol=1e-2)
    # The caches, read back at the slots through the contract's index expressions.
    slots = case.slot_mapping.tolist()
    islots = (kw["index_slot_mapping"] if kw["index_slot_mapping"] is not None else case.slot_mapping).tolist()
    ps = None if m.asm else bs
    if m.per_token:
        check_pertoken(case, kw, m.contract)
    else:
        for token, slot in enumerate(slots):
            k = fp8_view(read(m.contract, "k", kw["kv_cache_k"], slot, case.nkv, D, ps))
            v = fp8_view(read(m.contract, "v", kw["kv_cache_v"], slot, case.nkv, D, ps))
            k_ref, v_ref = refs["k"][token], refs["v"][token]
            if m.unit:  # fp8_unit_scale_ref
                k_ref, v_ref = k_ref.float().to(FP8), v_ref.float().to(FP8)
            close(k.float(), k_ref.float(), f"k_cache token {token}", rtol=1e-2, atol=1e-2)
            close(v.float(), v_ref.float(), f"v_cache token {token}", rtol=1e-2, atol=1e-2)
    if niq:
        for token, islot in enumerate(islots):
            row = fp8_view(read(m.contract, "index", kw["index_cache"], islot, case.nkv, D, bs)).float()
            ref = refs["index_k"][token]
            close(row, ref.float().to(FP8).float() if m.fp8_index else ref, f"index_cache token {token}",
                  rtol=1e-2, atol=1e-2)
    # Nothing written outside the addressed slots.
    assert_kv_only_at(m.contract, kw, before, slots, case.nkv, ps)
    if niq:
        assert_only_at("index_cache", before["index_cache"], kw["index_cache"],
                       addresses(m.contract, "index", kw["index_cache"], islots, case.nkv, bs))
    if m.per_token:
        for key, role in (("k_scale", "k_scale"), ("v_scale", "v_scale")):
            assert_only_at(key, before[key], kw[key], addresses(m.contract, role, kw[key], slots, case.nkv, bs))


# ---- #5143: the focused MiniMax-M3 TP4 cases ---------------------------------------------------
FOCUSED = [("auto", False, True), ("auto", True, False), ("fp8_e4m3_static", False, True),
           ("fp8_e4m3_static", True, True)]  # (kv_cache_dtype, skip_index_branch, supply_index_args)


def tp4_case(seed=123, num_tokens=3) -> Case:
    return make_case(BF16, num_tokens, 16, num_heads=16, num_kv_heads=1, num_index_heads=1, rotary_dim=64, seed=seed)


def focused_call(kv_cache_dtype, skip, supply, fp8=FP8, fp8_index_q=False) -> tuple[Call, Case]:
    """run_minimax_tp4_focused_case (and, fp8_index_q, run_minimax_tp4_fp8_index_q_case)."""
    static = kv_cache_dtype == "fp8_e4m3_static"
    case = tp4_case()
    case.slot_mapping = torch.tensor([0, -1, 17])
    case.index_slot_mapping = torch.tensor([2, -1, 20])
    q_out = torch.full((3, 16 * D), 13.0, dtype=BF16)
    if fp8_index_q:
        index_q_out = torch.zeros((3, D), dtype=fp8)
        index_cache = torch.zeros((case.num_blocks, 16, D), dtype=fp8)
    else:
        index_q_out = torch.full((3, D), 17.0, dtype=BF16)
        index_cache = torch.full((case.num_blocks, 16, D), 19.0, dtype=BF16)
    k_cache, v_cache = shuffle_caches(case.num_blocks, 1, 16, fp8 if static else BF16)
    k_scale = torch.tensor([0.25]) if static else None
    v_scale = torch.tensor([0.5]) if static else None
    give = not skip or supply
    kw = base_kw(case, case.qkv.clone())
    kw.update(index_q_norm_weight=case.iq_w if give else None, index_k_norm_weight=case.ik_w if give else None,
              slot_mapping=case.slot_mapping, kv_cache_k=k_cache, kv_cache_v=v_cache,
              index_cache=index_cache if give else None, block_size=16, q_out=q_out,
              index_q_out=index_q_out if give else None,
              index_slot_mapping=case.index_slot_mapping if give else None, kv_cache_dtype=kv_cache_dtype,
              index_cache_dtype=None if fp8_index_q else "auto", k_scale=k_scale, v_scale=v_scale, asm_layout=True,
              skip_index_branch=skip)
    return Call(fused_qknorm_idxrqknorm, kw, ("q_out", "index_q_out", "kv_cache_k", "kv_cache_v", "index_cache"),
                held=dict(index_q_out=index_q_out, index_cache=index_cache)), case


def inplace_skip_call(fp8=FP8) -> tuple[Call, Case]:
    """The focused case's extra non-insert call with skip_index_branch and no index arguments."""
    case = tp4_case()
    kw = dict(qkv=case.qkv.clone(), q_norm_weight=case.q_w, k_norm_weight=case.k_w, cos_sin_cache=case.cos_sin,
              positions=case.positions, num_heads=16, num_kv_heads=1, rotary_dim=64, eps=EPS, num_index_heads=1,
              skip_index_branch=True)
    return Call(fused_qknorm_idxrqknorm, kw, ()), case


def check_static_or_model_rows(case, kw, slots, static, tag) -> None:
    """K/V rows at the valid slots within 0.1 of the reference (static FP8: dequantized, of
    fp8(x / s) * s: fp8_cache_ref)."""
    for token, slot in enumerate(slots):
        if slot < 0:
            continue
        k = fp8_view(read("vllm_shuffle16", "k", kw["kv_cache_k"], slot, 1, D)).float()[0]
        v = fp8_view(read("vllm_shuffle16", "v", kw["kv_cache_v"], slot, 1, D)).float()[0]
        k_ref, v_ref = case.refs["k"][token, 0].float(), case.refs["v"][token, 0].float()
        if static:
            ks, vs = kw["k_scale"], kw["v_scale"]
            k, v = k * ks, v * vs
            k_ref, v_ref = (k_ref / ks).to(FP8).float() * ks, (v_ref / vs).to(FP8).float() * vs
        close(k, k_ref, f"{tag} k token {token}", rtol=0.1, atol=0.1)
        close(v, v_ref, f"{tag} v token {token}", rtol=0.1, atol=0.1)


@pytest.mark.parametrize("kv_cache_dtype,skip,supply", FOCUSED, ids=lambda x: str(x))
def test_minimax_tp4_focused(kv_cache_dtype, skip, supply):
    call, case = focused_call(kv_cache_dtype, skip, supply)
    kw = call.kw
    index_q_before, index_cache_before = call.held["index_q_out"].clone(), call.held["index_cache"].clone()
    k_before = storage_bits(kw["kv_cache_k"]), storage_bits(kw["kv_cache_v"])
    want = insert_direct(kw, "vllm_shuffle16")
    call.run()
    for key in ("q_out", "kv_cache_k", "kv_cache_v"):
        same_bytes(key, kw[key], want[key])
    close(kw["q_out"], case.refs["q"], "q", rtol=1e-2, atol=1e-2)
    assert torch.equal(kw["qkv"], case.qkv), "qkv was written (its index slices included)"
    slots = case.slot_mapping.tolist()
    check_static_or_model_rows(case, kw, slots, kv_cache_dtype == "fp8_e4m3_static", "tp4")
    # The padded token writes nothing, not even at the slot of its ordinal; nothing else is written.
    for role, key, before in (("k", "kv_cache_k", k_before[0]), ("v", "kv_cache_v", k_before[1])):
        assert torch.count_nonzero(read("vllm_shuffle16", role, kw[key], 1, 1, D).float()) == 0
        assert_only_at(key, before, kw[key], addresses("vllm_shuffle16", role, kw[key], slots, 1))
    if skip:
        assert torch.equal(call.held["index_q_out"], index_q_before)
        assert torch.equal(call.held["index_cache"], index_cache_before)
        if not supply:  # the non-insert skip path: only q and K, in place
            inplace, _ = inplace_skip_call()
            inplace.run()
            q, k, v, iq, ik = case.split(inplace.kw["qkv"])
            _, _, v0, iq0, ik0 = case.split(case.qkv)
            close(q, case.refs["q"], "inplace skip q", rtol=1e-2, atol=1e-2)
            close(k.view(3, 1, D), case.refs["k"], "inplace skip k", rtol=1e-2, atol=1e-2)
            for name, got, was in (("v", v, v0), ("index_q", iq, iq0), ("index_k", ik, ik0)):
                assert torch.equal(got, was), f"inplace skip: {name} was written"
        return
    same_bytes("index_q_out", kw["index_q_out"], want["index_q_out"])
    same_bytes("index_cache", kw["index_cache"], want["index_cache"])
    close(kw["index_q_out"], case.refs["index_q"], "index_q", rtol=1e-2, atol=1e-2)
    islots = case.index_slot_mapping.tolist()
    for token in (0, 2):
        row = read("vllm_shuffle16", "index", kw["index_cache"], islots[token], 1, D, 16)[0]
        close(row, case.refs["index_k"][token], f"index_k token {token}", rtol=1e-2, atol=1e-2)
    assert_only_at("index_cache", storage_bits(index_cache_before), kw["index_cache"],
                   addresses("vllm_shuffle16", "index", kw["index_cache"], islots, 1, 16))


def test_minimax_tp4_inplace_skip_matches_a_direct_call():
    call, case = inplace_skip_call()
    want = case.qkv.clone()
    q, k, *_ = case.split(want)
    no_slots = torch.empty(0, dtype=torch.int64)
    fused_qknorm_rope_cache(case.qkv, case.positions, case.cos_sin, no_slots, *shuffle_caches(1, 1, 16, BF16),
                            contract="vllm_shuffle16", q_out=q, k_out=k, index_mode="skip",
                            **native_common(call.kw, False))
    call.run()
    same_bytes("qkv", call.kw["qkv"], want)


# ---- #5143: FP8 index_q (PR 4787's q_idx contract) ----------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3_static"])
@pytest.mark.parametrize("skip", [False, True], ids=["full", "skip"])
def test_minimax_tp4_fp8_index_q(kv_cache_dtype, skip):
    """run_minimax_tp4_fp8_index_q_case: FP8 index_q_out and index cache, index_cache_dtype None.
    AITER compares index_q_out with fp8(bf16 ref); kvforge quantizes index_q from fp32 (SPEC §1),
    so here: AITER's tolerance against fp8 of the fp32 oracle, and one FP8 code of AITER's."""
    call, case = focused_call(kv_cache_dtype, skip, True, fp8_index_q=True)
    kw = call.kw
    before = call.held["index_q_out"].clone(), call.held["index_cache"].clone()
    want = insert_direct(kw, "vllm_shuffle16")
    call.run()
    for key in ("q_out", "kv_cache_k", "kv_cache_v", "index_q_out", "index_cache"):
        same_bytes(key, kw[key], want[key])
    close(kw["q_out"], case.refs["q"], "q", rtol=1e-2, atol=1e-2)
    check_static_or_model_rows(case, kw, case.slot_mapping.tolist(), kv_cache_dtype == "fp8_e4m3_static", "fp8-iq")
    if skip:
        assert torch.equal(kw["index_q_out"].view(torch.uint8), before[0].view(torch.uint8))
        assert torch.equal(kw["index_cache"].view(torch.uint8), before[1].view(torch.uint8))
        return
    fmax = torch.finfo(FP8).max
    close(kw["index_q_out"].float(), case.refs["iq32"].clamp(-fmax, fmax).to(FP8).float(), "index_q",
          rtol=1e-2, atol=1e-2)
    aiters = case.refs["index_q"].float().to(FP8)
    assert int((fp8_codes(kw["index_q_out"]) - fp8_codes(aiters)).abs().max()) <= 1
    for token in (0, 2):
        islot = case.index_slot_mapping[token].item()
        row = read("vllm_shuffle16", "index", kw["index_cache"], islot, 1, D, 16)[0].float()
        close(row, case.refs["index_k"][token].float().to(FP8).float(), f"index_k token {token}", rtol=1e-2, atol=1e-2)


def msa_call(fp8=FP8) -> tuple[Call, Case]:
    """run_fp8_index_q_msa_score_decode_case's fused call: page-128 views, FP8 index_q_out and
    index cache of 128-slot pages (the score kernel itself is AITER's, not here)."""
    case = make_case(BF16, 1, 128, num_heads=16, num_kv_heads=1, num_index_heads=1, rotary_dim=64)
    case.slot_mapping = case.index_slot_mapping = torch.tensor([0])
    kv = torch.zeros(case.num_blocks, 2, 128, 1, D, dtype=BF16)
    kw = base_kw(case, case.qkv.clone())
    kw.update(slot_mapping=case.slot_mapping, kv_cache_k=kv[:, 0], kv_cache_v=kv[:, 1],
              index_cache=torch.zeros((case.num_blocks, 128, D), dtype=fp8), block_size=128,
              q_out=torch.empty(1, 16 * D, dtype=BF16), index_q_out=torch.zeros((1, D), dtype=fp8),
              index_slot_mapping=case.index_slot_mapping, kv_cache_dtype="auto", index_cache_dtype=None,
              asm_layout=False, skip_index_branch=False)
    return Call(fused_qknorm_idxrqknorm, kw, ("q_out", "index_q_out", "kv_cache_k", "kv_cache_v", "index_cache")), case


def test_fp8_index_q_for_msa_score_decode():
    call, case = msa_call()
    kw = call.kw
    want = insert_direct(kw, "aiter_nhd")
    call.run()
    for key in call.writes:
        same_bytes(key, kw[key], want[key])
    fmax = torch.finfo(FP8).max
    close(kw["index_q_out"].float(), case.refs["iq32"].clamp(-fmax, fmax).to(FP8).float(), "index_q",
          rtol=1e-2, atol=1e-2)
    # What pa_sparse_block_score_decode reads: q_idx . index_cache[0, 0], both FP8.
    dot = (kw["index_q_out"].float()[0] * kw["index_cache"][0, 0].float()).sum()
    ref = case.refs["iq32"][0].clamp(-fmax, fmax).to(FP8).float() @ case.refs["index_k"][0].float().to(FP8).float()
    close(dot, ref, "q_idx . k_idx", rtol=1e-2, atol=1e-2)


# ---- #5143: the packed LBHNC page-16 SHUFFLE ----------------------------------------------------
LOGICAL = [0, 15, 16, 127, 128, 129, 255, 256, 383, -1]
REBASED = [0, 15, 16, 127, 256, 257, 383, 512, 639, -1]
PACKED_INDEX = [0, 1, 127, 128, 129, 255, 256, 383, 300, -1]


def packed_call(kv_cache_dtype, skip, fp8=FP8) -> tuple[Call, Case]:
    """run_minimax_tp4_packed_lbhnc_case: K and V page-16 views of one [3, 2, 128, D] allocation
    filled with 24.0 (V 8 pages in), rebased slots, static scales 0.125 / 0.25."""
    static = kv_cache_dtype == "fp8_e4m3_static"
    logical = torch.tensor(LOGICAL)
    rebased = torch.tensor(REBASED)
    assert torch.equal(rebased, logical.clamp_min(0).div(128, rounding_mode="floor").mul(128) + logical)
    case = make_case(BF16, 10, 16, num_heads=16, num_kv_heads=1, num_index_heads=1, rotary_dim=64, seed=20260831)
    case.slot_mapping, case.index_slot_mapping = rebased, torch.tensor(PACKED_INDEX)
    packed = torch.full((3, 2, 128, D), 24.0).to(fp8 if static else BF16)
    x = 16 // packed.element_size()
    k_cache = packed.view(48, 1, D // x, 16, x)
    v_cache = packed.view(48, 1, 16 // x, D, x)[8:]
    assert v_cache.storage_offset() == 8 * 16 * D and tuple(v_cache.shape) == (40, 1, 16 // x, D, x)
    kw = base_kw(case, case.qkv.clone())
    kw.update(slot_mapping=rebased, kv_cache_k=k_cache, kv_cache_v=v_cache,
              index_cache=torch.full((3, 128, D), 27.0, dtype=BF16), block_size=16,
              q_out=torch.full((10, 16 * D), 25.0, dtype=BF16), index_q_out=torch.full((10, D), 26.0, dtype=BF16),
              index_slot_mapping=case.index_slot_mapping, kv_cache_dtype=kv_cache_dtype, index_cache_dtype="auto",
              k_scale=torch.tensor([0.125]) if static else None, v_scale=torch.tensor([0.25]) if static else None,
              asm_layout=True, skip_index_branch=skip)
    return Call(fused_qknorm_idxrqknorm, kw, ("q_out", "index_q_out", "kv_cache_k", "kv_cache_v", "index_cache"),
                held=dict(packed=packed)), case


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3_static"])
@pytest.mark.parametrize("skip", [False, True], ids=["full", "skip"])
def test_minimax_tp4_packed_lbhnc(kv_cache_dtype, skip):
    call, case = packed_call(kv_cache_dtype, skip)
    kw, packed = call.kw, call.held["packed"]
    index_q_before, index_cache_before = kw["index_q_out"].clone(), kw["index_cache"].clone()
    want = insert_direct(kw, "vllm_shuffle16")
    call.run()
    for key in call.writes:
        same_bytes(key, kw[key], want[key])
    close(kw["q_out"], case.refs["q"], "packed q", rtol=1e-2, atol=1e-2)
    assert torch.equal(kw["qkv"], case.qkv), "qkv was written (its index slices included)"
    check_static_or_model_rows(case, kw, REBASED, kv_cache_dtype == "fp8_e4m3_static", "packed")
    # Each written element at its absolute place in the packed allocation; every other keeps 24.
    x = 16 // packed.element_size()
    flat = fp8_view(packed).view(-1).float()
    written = torch.zeros(packed.numel(), dtype=torch.bool)
    d = torch.arange(D)
    for slot in REBASED:
        if slot < 0:
            continue
        page, off = divmod(slot, 16)
        k_abs = page * 16 * D + (d // x) * (16 * x) + off * x + d % x
        v_abs = (8 + page) * 16 * D + (off // x) * (D * x) + d * x + off % x
        written[k_abs] = written[v_abs] = True
        assert torch.equal(flat[k_abs], read("vllm_shuffle16", "k", kw["kv_cache_k"], slot, 1, D)[0].float())
        assert torch.equal(flat[v_abs], read("vllm_shuffle16", "v", kw["kv_cache_v"], slot, 1, D)[0].float())
    assert bool((flat[~written] == 24.0).all()), "packed bytes outside the slots were written"
    assert int(written.sum()) == 2 * 9 * D
    if skip:
        assert torch.equal(kw["index_q_out"], index_q_before) and torch.equal(kw["index_cache"], index_cache_before)
        return
    close(kw["index_q_out"], case.refs["index_q"], "packed index_q", rtol=1e-2, atol=1e-2)
    rows = torch.zeros(3 * 128, dtype=torch.bool)
    for token, islot in enumerate(PACKED_INDEX):
        if islot < 0:
            continue
        rows[islot] = True
        close(kw["index_cache"].view(-1, D)[islot], case.refs["index_k"][token], f"packed index_k token {token}",
              rtol=1e-2, atol=1e-2)
    assert bool((kw["index_cache"].view(-1, D)[~rows] == 27).all())


# ---- #4813: minimax_m3_qknorm_rope_cache_shuffle_insert -----------------------------------------
def m3_inputs(T, nq, nkv, niq, R, dtype, cache_dtype, idx_dtype, num_pages, idx_num_pages, seed=0) -> dict:
    """#4813's make_inputs: random cos/sin (not real frequencies), SHUFFLE page 16, index pages of
    16, distinct slots, slot_mapping[1] = index_slot_mapping[2] = -1 from 4 tokens on."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (nq + 2 * nkv + niq + 1) * D, generator=g).to(dtype)
    weights = {name: torch.randn(D, generator=g).to(dtype) * 0.1 for name in ("q", "k", "iq", "ik")}
    cos_sin = torch.randn(4096, R, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (T,), generator=g)
    x = 16 // torch.empty((), dtype=cache_dtype).element_size()
    t = dict(qkv=qkv, weights=weights, cos_sin=cos_sin, positions=positions, x=x,
             k_cache=torch.zeros(num_pages, nkv, D // x, 16, x, dtype=cache_dtype),
             v_cache=torch.zeros(num_pages, nkv, 16 // x, D, x, dtype=cache_dtype),
             index_cache=torch.zeros(idx_num_pages, 16, D, dtype=idx_dtype),
             slot_mapping=torch.randperm(num_pages * 16, generator=g)[:T],
             index_slot_mapping=torch.randperm(idx_num_pages * 16, generator=g)[:T],
             q_out=torch.zeros(T, nq * D, dtype=dtype), index_q_out=torch.zeros(T, niq * D, dtype=idx_dtype))
    if T >= 4:
        t["slot_mapping"][1] = -1
        t["index_slot_mapping"][2] = -1
    return t


def m3_reference(t, nq, nkv, niq, R, process_index, k_scale, v_scale):
    """#4813's reference: (q_out, index_q_out, k_cache, v_cache, index_cache)."""
    qkv, w = t["qkv"], t["weights"]
    T, dtype, x = qkv.shape[0], qkv.dtype, t["x"]
    cache_dtype, idx_dtype = t["k_cache"].dtype, t["index_cache"].dtype
    heads = qkv.view(T, -1, D)
    nr = lambda sub, weight: norm_rope(sub, weight, t["positions"], t["cos_sin"], R)  # noqa: E731
    q = nr(heads[:, :nq], w["q"]).to(dtype)
    k = nr(heads[:, nq:nq + nkv], w["k"]).to(dtype)
    v = heads[:, nq + nkv:nq + 2 * nkv]
    b = nq + 2 * nkv
    iq32 = nr(heads[:, b:b + niq], w["iq"])
    ik = nr(heads[:, b + niq:b + niq + 1], w["ik"]).to(dtype)
    iq_src = iq32 if idx_dtype != dtype else iq32.to(dtype)
    iq_ref = iq_src.reshape(T, niq * D).clamp(-448.0, 448.0).to(idx_dtype)
    k_ref, v_ref, idx_ref = (torch.zeros_like(t[n]) for n in ("k_cache", "v_cache", "index_cache"))

    def quant(vals, scale):
        if cache_dtype == dtype:
            return vals
        f = vals.float()
        return (f / scale.item() if scale is not None else f).to(cache_dtype)

    for tok in range(T):
        slot = int(t["slot_mapping"][tok])
        if slot >= 0:
            page, off = divmod(slot, 16)
            k_ref[page, :, :, off, :] = quant(k[tok], k_scale).view(nkv, D // x, x)
            v_ref[page, :, off // x, :, off % x] = quant(v[tok], v_scale)
        islot = int(t["index_slot_mapping"][tok])
        if process_index and islot >= 0:
            ipage, ioff = divmod(islot, 16)
            idx_ref[ipage, ioff] = ik[tok, 0].to(idx_dtype)
    return q.reshape(T, nq * D), iq_ref, k_ref, v_ref, idx_ref


def m3_compare(name, got, ref) -> None:
    """#4813's compare: within rtol = atol = 2e-2 and more than 90% bit-exact."""
    g, r = got.float(), ref.float()
    torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")
    exact = (g == r).float().mean().item()
    assert exact > 0.9, f"{name}: only {exact:.1%} of elements bit-exact"


def m3_call(t, nq, nkv, niq, R, *, index=True, **extra) -> Call:
    kw = dict(qkv=t["qkv"], q_norm_weight=t["weights"]["q"], k_norm_weight=t["weights"]["k"],
              cos_sin_cache=t["cos_sin"], positions=t["positions"], num_heads=nq, num_kv_heads=nkv,
              num_index_heads=niq, rotary_dim=R, eps=EPS, slot_mapping=t["slot_mapping"], k_cache=t["k_cache"],
              v_cache=t["v_cache"], q_out=t["q_out"])
    if index:
        kw.update(index_q_norm_weight=t["weights"]["iq"], index_k_norm_weight=t["weights"]["ik"],
                  index_slot_mapping=t["index_slot_mapping"], index_cache=t["index_cache"],
                  index_q_out=t["index_q_out"])
    kw.update(extra)
    writes = ("q_out", "k_cache", "v_cache") + (("index_q_out", "index_cache") if index else ())
    return Call(minimax_m3_qknorm_rope_cache_shuffle_insert, kw, writes)


def m3_direct(call: Call) -> dict:
    """The #4813 call as a direct one: SHUFFLE, a per-tensor scale (1.0 where none), index
    tensors only without skip_index_branch."""
    n = clone_args(call.kw)
    fp8 = n["k_cache"].dtype != n["qkv"].dtype
    ones = torch.ones(1)
    skip = n.get("skip_index_branch", False)
    index = {} if skip else dict(index_q_norm_weight=n["index_q_norm_weight"],
                                 index_k_norm_weight=n["index_k_norm_weight"], index_cache=n["index_cache"],
                                 index_slot_mapping=n["index_slot_mapping"], index_q_out=n["index_q_out"])
    fused_qknorm_rope_cache(
        n["qkv"], n["positions"], n["cos_sin_cache"], n["slot_mapping"], n["k_cache"], n["v_cache"],
        contract="vllm_shuffle16", q_out=n["q_out"], q_norm_weight=n["q_norm_weight"],
        k_norm_weight=n["k_norm_weight"], num_heads=n["num_heads"], num_kv_heads=n["num_kv_heads"],
        num_index_heads=n["num_index_heads"], rotary_dim=n["rotary_dim"], eps=n["eps"],
        k_scale=(n.get("k_scale") if n.get("k_scale") is not None else ones) if fp8 else None,
        v_scale=(n.get("v_scale") if n.get("v_scale") is not None else ones) if fp8 else None,
        index_mode="skip" if skip else "full", **index)
    return n


def m3_insert_call(quantized, fp8_index, T, fp8=FP8):
    t = m3_inputs(T, 16, 1, 1, 64, BF16, fp8 if quantized else BF16, fp8 if fp8_index else BF16, 8, 8)
    scales = dict(k_scale=torch.tensor([0.7]), v_scale=torch.tensor([1.3])) if quantized else {}
    return m3_call(t, 16, 1, 1, 64, kv_cache_dtype="fp8" if quantized else "auto", **scales), t


def m3_multi_call(fp8=FP8):
    t = m3_inputs(48, 32, 4, 2, D, BF16, fp8, fp8, 16, 8)
    return m3_call(t, 32, 4, 2, D, kv_cache_dtype="fp8", k_scale=torch.tensor([1.0]),
                   v_scale=torch.tensor([1.0])), t


def m3_skip_call(pass_index: bool, fp8=FP8):
    t = m3_inputs(32, 16, 1, 1, 64, BF16, BF16, BF16, 8, 8)
    return m3_call(t, 16, 1, 1, 64, index=pass_index, skip_index_branch=True), t


def m3_check(call: Call, t, nq, nkv, niq, R, process_index=True) -> None:
    kw = call.kw
    before = {k: storage_bits(kw[k]) for k in call.writes}
    want = m3_direct(call)
    call.run()
    for key in call.writes:
        same_bytes(key, kw[key], want[key])
    refs = m3_reference(t, nq, nkv, niq, R, process_index, kw.get("k_scale"), kw.get("v_scale"))
    for name, ref in zip(("q_out", "index_q_out", "k_cache", "v_cache", "index_cache"), refs):
        if name in call.writes and (process_index or not name.startswith("index")):
            m3_compare(name, kw[name], ref)
    assert_kv_only_at("vllm_shuffle16", kw, before, t["slot_mapping"].tolist(), nkv)
    if "index_cache" in call.writes:  # with skip_index_branch: nothing
        islots = t["index_slot_mapping"].tolist() if process_index else []
        assert_only_at("index_cache", before["index_cache"], kw["index_cache"],
                       addresses("vllm_shuffle16", "index", kw["index_cache"], islots, nkv, kw["index_cache"].shape[1]))
        if not process_index:
            assert torch.equal(storage_bits(kw["index_q_out"]), before["index_q_out"]), "index_q_out was written"


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("fp8_index", [False, True], ids=["bf16_index", "fp8_index"])
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16_kv", "fp8_kv"])
def test_m3_fused_insert(quantized, fp8_index, num_tokens):
    call, t = m3_insert_call(quantized, fp8_index, num_tokens)
    m3_check(call, t, 16, 1, 1, 64)


@pytest.mark.parametrize("pass_index", [False, True], ids=["no_index_args", "index_args_ignored"])
def test_m3_skip_index_branch_leaves_index_outputs_untouched(pass_index):
    call, t = m3_skip_call(pass_index)
    m3_check(call, t, 16, 1, 1, 64, process_index=False)
    assert t["index_cache"].float().abs().sum() == 0
    assert t["index_q_out"].float().abs().sum() == 0


def test_m3_multi_kv_head_and_full_rotary():
    call, t = m3_multi_call()
    m3_check(call, t, 32, 4, 2, D)


def m3_lenient_call(scale: Optional[str], fp8=FP8):
    """What AITER accepts beyond the native rules: positions and slot maps longer than T (the
    first T read), a missing or empty FP8 scale (1.0), an index cache of 8-slot pages."""
    t = m3_inputs(7, 16, 1, 1, 64, BF16, fp8, BF16, 8, 16)
    t["index_cache"] = t["index_cache"].view(32, 8, D)
    pad = torch.full((5,), 10 ** 9, dtype=torch.int64)
    scales = {"none": None, "empty": torch.empty(0)}[scale]
    call = m3_call(t, 16, 1, 1, 64, kv_cache_dtype="fp8_e4m3", k_scale=scales, v_scale=scales,
                   positions=torch.cat([t["positions"], pad]), slot_mapping=torch.cat([t["slot_mapping"], pad]),
                   index_slot_mapping=torch.cat([t["index_slot_mapping"], pad]))
    return call, t


@pytest.mark.parametrize("scale", ["none", "empty"])
def test_m3_accepts_what_aiter_accepts(scale):
    call, t = m3_lenient_call(scale)
    call.run()
    # The same inputs with exactly T entries, a unit scale and 16-slot index pages.
    plain = m3_inputs(7, 16, 1, 1, 64, BF16, FP8, BF16, 8, 16)
    ref = m3_call(plain, 16, 1, 1, 64, kv_cache_dtype="fp8", k_scale=torch.ones(1), v_scale=torch.ones(1))
    ref.run()
    for key in call.writes:
        same_bytes(key, call.kw[key], ref.kw[key])
    refs = m3_reference(plain, 16, 1, 1, 64, True, torch.ones(1), torch.ones(1))
    for name, r in zip(("q_out", "index_q_out", "k_cache", "v_cache", "index_cache"), refs):
        m3_compare(name, call.kw[name].reshape(r.shape), r)


def test_m3_fp8_e4m3_is_fp8():
    """#4813 dispatches 'fp8' and 'fp8_e4m3' alike: a static scale, values times 1/scale."""
    a, _ = m3_insert_call(True, True, 7)
    b = clone_args(a.kw)
    a.run()
    minimax_m3_qknorm_rope_cache_shuffle_insert(**dict(b, kv_cache_dtype="fp8_e4m3"))
    for key in a.writes:
        same_bytes(key, a.kw[key], b[key])


def test_idxrqknorm_accepts_what_aiter_accepts():
    """Positions and slot maps longer than T (the first T read), index_slot_mapping None on
    SHUFFLE (the KV slots), per-token scales passed flat (AITER checks only their numel), an
    index cache of 8-slot pages (addressed flat): the bytes of the plain call."""
    plain, case = default_call("asm_layout_fp8_pertoken", BF16, 17, 16, 64, 4)
    mine = clone_args(plain.kw)
    plain.kw["index_slot_mapping"] = case.slot_mapping
    pad = torch.full((3,), 10 ** 9, dtype=torch.int64)
    mine.update(positions=torch.cat([case.positions, pad]), slot_mapping=torch.cat([case.slot_mapping, pad]),
                index_slot_mapping=None, k_scale=mine["k_scale"].view(-1), v_scale=mine["v_scale"].view(-1),
                index_cache=mine["index_cache"].view(-1, 8, D))
    plain.run()
    fused_qknorm_idxrqknorm(**mine)
    for key in plain.writes:
        same_bytes(key, mine[key], plain.kw[key])


def test_idxrqknorm_ignores_scales_with_auto():
    plain, _ = default_call("asm_layout", BF16, 17, 16, 64, 4)
    mine = clone_args(plain.kw)
    mine.update(k_scale=torch.ones(1), v_scale=torch.ones(1))
    plain.run()
    fused_qknorm_idxrqknorm(**mine)
    for key in plain.writes:
        same_bytes(key, mine[key], plain.kw[key])


# ---- the drop-ins' argument lists and their own checks ---------------------------------------
def test_fused_qknorm_idxrqknorm_keeps_aiters_argument_list():
    params = inspect.signature(fused_qknorm_idxrqknorm).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("qkv", inspect.Parameter.empty), ("q_norm_weight", inspect.Parameter.empty),
        ("k_norm_weight", inspect.Parameter.empty), ("cos_sin_cache", inspect.Parameter.empty),
        ("positions", inspect.Parameter.empty), ("num_heads", inspect.Parameter.empty),
        ("num_kv_heads", inspect.Parameter.empty), ("rotary_dim", inspect.Parameter.empty),
        ("eps", inspect.Parameter.empty), ("index_q_norm_weight", None), ("index_k_norm_weight", None),
        ("num_index_heads", 0), ("slot_mapping", None), ("kv_cache_k", None), ("kv_cache_v", None),
        ("index_cache", None), ("block_size", 0), ("q_out", None), ("index_q_out", None),
        ("index_slot_mapping", None), ("kv_cache_dtype", "auto"), ("index_cache_dtype", None), ("k_scale", None),
        ("v_scale", None), ("asm_layout", False), ("skip_index_branch", False)]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())


def _asm_page8(kw):
    """SHUFFLE caches of 8-slot pages, block_size 8."""
    k, v = shuffle_caches(kw["kv_cache_k"].shape[0] * 2, 4, 8, BF16)
    return dict(kv_cache_k=k, kv_cache_v=v, block_size=8)


BAD = [  # (id, default-case mode, changes (or a function of the valid arguments), exception, blamed, pattern)
    ("asm-block_size-8", "asm_layout", _asm_page8, ValueError, "block_size",
     r"expected 16 \(asm_layout=True: SHUFFLE pages of 16 slots\), got 8"),
    ("asm-cache-pages-of-8", "asm_layout", lambda kw: {**_asm_page8(kw), "block_size": 16}, ValueError, "kv_cache_k",
     r"expected pages of block_size=16 slots \(dimension 3\), got shape \(6, 4, 16, 8, 8\)"),
    ("nhd-block_size-mismatch", "insert", {"block_size": 8}, ValueError, "kv_cache_k",
     r"expected pages of block_size=8 slots \(dimension 1\), got shape \(2, 16, 4, 128\)"),
    ("unit-with-k_scale", "fp8_kv_cache_unit", {"k_scale": torch.ones(1)}, ValueError, "k_scale",
     re.escape("expected None (kv_cache_dtype='fp8_e4m3_unit' takes no scale), got a float32 tensor of shape (1,)")),
    ("kv_cache_dtype-unknown", "insert", {"kv_cache_dtype": "fp8_e5m2"}, ValueError, "kv_cache_dtype",
     re.escape("expected one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e4m3_unit', 'fp8_e4m3_static', got 'fp8_e5m2'")),
    ("kv_cache_dtype-type", "insert", {"kv_cache_dtype": None}, TypeError, "kv_cache_dtype",
     r"expected one of .* \(a str\), got None"),
    ("per-token-without-scales", "fp8_kv_cache_pertoken", {"v_scale": None}, ValueError, "v_scale",
     re.escape("expected a float32 tensor the op fills with per-token scales (kv_cache_dtype='fp8_e4m3'), got None")),
    ("static-without-scales", "asm_layout_fp8_pertoken", {"kv_cache_dtype": "fp8_e4m3_static", "k_scale": None},
     ValueError, "k_scale", re.escape("expected a one-element float32 tensor (a static scale)")),
    ("auto-with-fp8-cache", "fp8_kv_cache_unit", {"kv_cache_dtype": "auto"}, TypeError, "kv_cache_k",
     re.escape("expected dtype bfloat16 (kv_cache_dtype='auto': the dtype of qkv), got float8_e4m3fn")),
    ("fp8-index-auto", "asm_layout_fp8_index", {"index_cache_dtype": "auto"}, TypeError, "index_cache",
     re.escape("expected dtype bfloat16 (index_cache_dtype='auto': the dtype of qkv), got float8_e4m3fn")),
    ("index_cache_dtype-unknown", "insert", {"index_cache_dtype": "int8"}, ValueError, "index_cache_dtype",
     re.escape("expected None, 'auto' or an 'fp8…' name, got 'int8' (str)")),
    ("kv_cache_v-missing", "insert", {"kv_cache_v": None}, ValueError, "kv_cache_v",
     re.escape("expected a tensor (kv_cache_k is given: pass both caches or neither), got None")),
    # index_q_out in the model dtype beside an FP8 index cache takes a second launch: its
    # index_q_out is checked before the first launch writes anything.
    ("model-index_q_out-dtype", "asm_layout_fp8_index", lambda kw: {"index_q_out": kw["index_q_out"].half()},
     TypeError, "index_q_out", re.escape("expected dtype bfloat16 (the dtype of qkv) or float8_e4m3fn (the dtype "
                                         "of index_cache), got float16")),
    ("model-index_q_out-shape", "asm_layout_fp8_index", lambda kw: {"index_q_out": kw["index_q_out"][:, :256]},
     ValueError, "index_q_out", re.escape("expected shape (17, 4, 128) or (17, 512), got (17, 256)")),
    ("block_size-zero", "insert", {"block_size": 0}, ValueError, "block_size",
     re.escape("expected a positive integer (the page size of kv_cache_k and kv_cache_v), got 0")),
]


@pytest.mark.parametrize("mode,changes,exc,blame,pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_through_fused_qknorm_idxrqknorm(mode, changes, exc, blame, pattern):
    row = next(c for c in DEFAULT_CASES if c[0] == mode)
    call, _ = default_call(*row)
    kw = dict(call.kw, **(changes(call.kw) if callable(changes) else changes))
    before = {k: storage_bits(t) for k, t in kw.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(exc) as info:
        fused_qknorm_idxrqknorm(**kw)
    message = str(info.value)
    assert FORM.match(message) and message.startswith(f"{blame}: "), message
    assert re.search(pattern, message), message
    for k, saved in before.items():
        assert torch.equal(storage_bits(kw[k]), saved), f"{k} was written by a refused call"


# ---- GPU: every case on CUDA tensors against the reference (SPEC §6) ---------------------------
def _gpu_cases() -> list:
    """(id, builder(fp8) -> Call) for every case above."""
    cases = [(f"m3-insert-{'fp8' if q else 'bf16'}kv-{'fp8' if i else 'bf16'}index-t{T}",
              functools.partial(m3_insert_call, q, i, T)) for q in (False, True) for i in (False, True)
             for T in (1, 7, 64)]
    cases += [("m3-skip", functools.partial(m3_skip_call, False)),
              ("m3-skip-index-args", functools.partial(m3_skip_call, True)),
              ("m3-multi-kv-head", m3_multi_call),
              ("m3-longer-vectors-no-scale", functools.partial(m3_lenient_call, "none")),
              ("m3-longer-vectors-empty-scale", functools.partial(m3_lenient_call, "empty"))]
    cases += [(f"default-{default_id(c)}", functools.partial(default_call, *c)) for c in DEFAULT_CASES]
    cases += [(f"tp4-{kv}-{'skip' if skip else 'full'}-{'args' if supply else 'noargs'}",
               functools.partial(focused_call, kv, skip, supply)) for kv, skip, supply in FOCUSED]
    cases += [("tp4-inplace-skip", inplace_skip_call)]
    cases += [(f"tp4-fp8-index-q-{kv}-{'skip' if skip else 'full'}",
               functools.partial(focused_call, kv, skip, True, fp8_index_q=True))
              for kv in ("auto", "fp8_e4m3_static") for skip in (False, True)]
    cases += [(f"packed-{kv}-{'skip' if skip else 'full'}", functools.partial(packed_call, kv, skip))
              for kv in ("auto", "fp8_e4m3_static") for skip in (False, True)]
    cases += [("msa-fp8-index-q", msa_call)]
    return cases


GPU_CASES = _gpu_cases()


def _gpu_fp8() -> torch.dtype:
    return engine_args.platform_fp8(torch.device("cuda"))


def _variants_of(call: Call) -> list:
    """The variants a drop-in call launches: its native calls validated (check), not run."""
    found = []
    sig = inspect.signature(fused_qknorm_rope_cache)

    def record(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        found.append(check(outputs=False, **{name: bound.arguments[name] for name in CALL_NAMES})[0])
        return None, None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aiter_compat, "fused_qknorm_rope_cache", record)
        call.run(clone_args(call.kw))
    return found


@pytest.fixture(scope="module")
def aiter_variants_built():
    """Every variant the cases launch (many are in no family: fp16, rotary 96 and 128, pages
    of 8 and 1), derived on CPU arguments and built in parallel before the first GPU case."""
    variants = {v.uri: v for _, builder in GPU_CASES for v in _variants_of(builder(fp8=_gpu_fp8())[0])}
    build.build_many([build.Job(v.uri, source_of(v)) for v in variants.values()], toolchain.default())
    return variants


def _poison(kw: dict, keys, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    done = set()
    for key in keys:
        t = kw.get(key)
        if t is None:
            continue
        base = t if t._base is None else t._base
        if id(base) in done:
            continue
        done.add(id(base))
        raw = torch.randint(0, 256, (base.numel() * base.element_size(),), generator=gen, dtype=torch.uint8)
        base.view(torch.uint8).view(-1).copy_(raw.to(base.device))


def _written_keys(call: Call) -> tuple:
    """What the call writes (outputs, caches, per-token scales), where passed."""
    return tuple(k for k in call.writes if call.kw.get(k) is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("builder", [b for _, b in GPU_CASES], ids=[i for i, _ in GPU_CASES])
def test_gpu_matches_reference(builder, aiter_variants_built):
    """The case on CUDA tensors, its outputs and caches poisoned, against the drop-in run on the
    torch reference with the same and with the complementary poison: every byte of every
    output, cache, scale cache and of qkv (written in place in some modes) at SPEC §6's bar."""
    call, _ = builder(fp8=_gpu_fp8())
    written = _written_keys(call)
    dev = clone_args(call.kw, "cuda")
    _poison(dev, written, seed=5)
    refs = [clone_args(dev, "cuda"), clone_args(dev, "cuda", invert=frozenset(written))]
    call.run(dev)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aiter_compat, "fused_qknorm_rope_cache", reference_qknorm_rope_cache)
        for ref in refs:
            call.run(ref)
    torch.cuda.synchronize()
    seen = set()
    for key in ("qkv", *written):
        t = dev[key]
        base = t if t._base is None else t._base
        if id(base) in seen:
            continue
        seen.add(id(base))
        r1, r2 = (r[key] if r[key]._base is None else r[key]._base for r in refs)
        compare(key, base, r1, r2)
