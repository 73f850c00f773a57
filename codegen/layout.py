"""What a contract's index expressions mean for one variant.

Given concrete sizes (head_dim, kv heads, element size), a cache's expressions are
turned into: extents, an element offset expression (compile-time symbols folded
in, free strides left as run-time names), and the widest vector the kernel may
store along `d` (one token, neighbouring dims) or along the slot (neighbouring
tokens of one page, one dim). These facts are *proven* by enumerating every
(off, h, d) of one page, never assumed from the layout's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import expr as ex
from .model import SCALE_ROLES, Cache, IndexDtype, KvScale, Variant

VEC = 8  # model-dtype elements per 16-byte access of the kernel


def stride_symbol(dim: int) -> str:
    """The name a free (run-time) stride of cache dimension `dim` has in offset expressions."""
    return f"s{dim}"


@dataclass(frozen=True)
class CacheAccess:
    """A cache as the kernel sees it for one variant."""

    role: str
    tensor: str
    elem_size: int                    # bytes per stored element (1 = FP8)
    page_size: int
    heads: int                        # kv heads, or 1 for the index cache
    extents: tuple[int | None, ...]   # None at the run-time (page count) dimension
    runtime_dim: int
    free: tuple[int, ...]
    free_symbols: tuple[tuple[str, int], ...]  # (symbol, dim) of each free stride
    contiguous_strides: tuple[int | None, ...]  # None where the stride is free
    offset: ex.Expr                   # element offset in terms of page, off, h, d, s<dim>
    d_vec: int                        # elements one store may cover along d
    slot_vec: int                     # tokens one store may cover along the slot (1 = no)
    counts_slots: bool                # the run-time extent counts slots, not pages

    def capacity(self, shape) -> int:
        """Slots a tensor of this shape holds."""
        return shape[self.runtime_dim] * (1 if self.counts_slots else self.page_size)

    @property
    def transposed(self) -> bool:
        """One token's dims are scattered and a page's tokens gathered (SHUFFLE's V): the
        kernel may write this cache by its V loop (kvf_args_t::v_loop)."""
        return self.d_vec == 1 and self.slot_vec > 1

    def offset_cpp(self) -> str:
        names = {"page": "page", "off": "off", "h": "h", "d": "d"}
        names.update({sym: f"c.strides[{i}]" for sym, i in self.free_symbols})
        return ex.to_cpp(self.offset, names)

    def offset_torch(self, page, off, h, d, strides):
        # No string is built here: under torch.compile(dynamic=True) the dims are symbolic
        # and formatting one breaks the graph (then a recompile per call site and variant).
        env = {"page": page, "off": off, "h": h, "d": d}
        env.update({sym: strides[i] for sym, i in self.free_symbols})
        return ex.evaluate(self.offset, env)


def v_transposed(v: Variant) -> bool:
    """Whether the variant's kernel has a V loop (its V's kTransposed)."""
    return access(v, "v").transposed


def elem_size(v: Variant, role: str) -> int:
    if role in SCALE_ROLES:
        return 4  # fp32 scales
    if role == "index":
        return 1 if v.index_dtype is IndexDtype.FP8 else v.dtype.size
    return 1 if v.kv_scale is not KvScale.NONE else v.dtype.size


def _symbols(v: Variant, cache: Cache) -> dict[str, int]:
    return {"D": v.head_dim, "nkv": v.num_kv_heads, "x": 16 // elem_size(v, cache.role),
            "page_size": v.page_size(cache.role)}


def _slot_folded(e: ex.Expr) -> ex.Expr:
    """`slot` spelled as what it is, page * page_size + off (the kernel's offsets take both)."""
    slot = ex.BinOp("+", ex.BinOp("*", ex.Sym("page"), ex.Sym("page_size")), ex.Sym("off"))
    if isinstance(e, ex.Sym):
        return slot if e.name == "slot" else e
    if isinstance(e, ex.BinOp):
        return ex.BinOp(e.op, _slot_folded(e.lhs), _slot_folded(e.rhs))
    return e


def _head_dim(v: Variant, cache: Cache) -> int:
    """Dims a cache holds per (slot, head): a scale cache holds one value."""
    return 1 if cache.role in SCALE_ROLES else v.head_dim


@lru_cache(maxsize=None)
def access(v: Variant, role: str) -> CacheAccess:
    cache: Cache = getattr(v.contract, role)
    syms = _symbols(v, cache)
    extents = _extents(cache, syms)
    strides = _strides(cache, extents)
    offset = ex.substitute(_plain_offset(cache, strides), syms)
    heads = 1 if role == "index" else v.num_kv_heads
    grid = _page_grid(v.page_size(role), heads, _head_dim(v, cache))
    d_vec, slot_vec = _vector_widths(v, cache, offset, grid, extents)
    return CacheAccess(role=role, tensor=cache.tensor, elem_size=elem_size(v, role),
                       page_size=v.page_size(role), heads=heads, extents=tuple(extents),
                       runtime_dim=cache.runtime_dim, free=cache.free,
                       free_symbols=tuple((stride_symbol(i), i) for i in cache.free),
                       contiguous_strides=tuple(strides), offset=offset,
                       d_vec=d_vec, slot_vec=slot_vec, counts_slots=cache.counts_slots)


# The proofs enumerate a page with numpy (the code generator does not import torch).
def _page_grid(page_size: int, heads: int, head_dim: int):
    off = np.arange(page_size, dtype=np.int64).reshape(-1, 1, 1)
    h = np.arange(heads, dtype=np.int64).reshape(1, -1, 1)
    d = np.arange(head_dim, dtype=np.int64).reshape(1, 1, -1)
    return off, h, d


def _within_page(acc_offset: ex.Expr, cache: Cache, extents: list[int | None], grid) -> np.ndarray:
    """Element offsets of one page (page 0). A free stride is taken as it would be in a
    contiguous tensor of one page (that of a dim indexed by `page` does not matter there;
    one indexed by `h` is validated at run time to keep the heads apart)."""
    off, h, d = grid
    env = {"page": 0, "off": off, "h": h, "d": d}
    one_page = [1 if e is None else e for e in extents]
    if cache.counts_slots:
        one_page[cache.runtime_dim] = off.shape[0]
    env.update({stride_symbol(i): int(np.prod(one_page[i + 1:])) for i in cache.free})
    out = np.asarray(ex.evaluate(acc_offset, env), dtype=np.int64)
    return np.broadcast_to(out, (off.shape[0], h.shape[1], d.shape[2]))


def _vector_widths(v: Variant, cache: Cache, offset: ex.Expr, grid, extents) -> tuple[int, int]:
    if cache.role in SCALE_ROLES:
        return 1, 1  # one fp32 per (slot, head), written alone
    offs = _within_page(offset, cache, extents, grid)
    max_elems = 16 // elem_size(v, cache.role)

    def contiguous(t: np.ndarray, w: int) -> bool:
        # t's last dim is the candidate vector axis: aligned runs of w must be +1 steps
        # from an offset that is itself a multiple of w.
        if t.shape[-1] % w:
            return False
        runs = t.reshape(*t.shape[:-1], -1, w)
        step = runs - runs[..., :1]
        return bool((step == np.arange(w)).all() and (runs[..., 0] % w == 0).all())

    d_vec = 1
    for w in (16, 8, 4, 2):
        if w <= min(VEC, max_elems) and contiguous(offs, w):
            d_vec = w
            break
    slot_vec = 1
    if d_vec == 1:
        by_slot = offs.transpose(1, 2, 0)  # (h, d, off): consecutive tokens of one page
        for w in (16, 8, 4, 2):
            if w <= max_elems and contiguous(by_slot, w):
                slot_vec = w
                break
    return d_vec, slot_vec


@lru_cache(maxsize=None)
def page_size_from(v: Variant, role: str, shape: tuple[int, ...]) -> int | None:
    """The page size, among those the contract's cache allows, at which a tensor of `shape`
    has the cache's shape (its run-time extent aside), for v's sizes and dtypes; None if none."""
    cache: Cache = getattr(v.contract, role)
    for ps in cache.page_sizes:
        try:
            extents = _extents(cache, {**_symbols(v, cache), "page_size": ps})
        except ZeroDivisionError:
            continue
        if len(extents) == len(shape) and all(e is None or e == n for e, n in zip(extents, shape)):
            return ps
    return None


def _extents(cache: Cache, syms) -> list[int | None]:
    return [None if i == cache.runtime_dim else ex.evaluate(e, syms)
            for i, e in enumerate(cache.shape)]


def _strides(cache: Cache, extents: list[int | None]) -> list[int | None]:
    """Row-major element strides; None for free dims (read from the tensor)."""
    out: list[int | None] = []
    for i in range(len(extents)):
        s = 1
        for e in extents[i + 1:]:
            s *= e if e is not None else 1
        out.append(None if i in cache.free else s)
    return out


def _plain_offset(cache: Cache, strides: list[int | None]) -> ex.Expr:
    """Sum of index * stride, free strides named s<dim>; symbols not yet folded."""
    offset: ex.Expr = ex.Num(0)
    for i, idx in enumerate(cache.index):
        stride: ex.Expr = ex.Sym(stride_symbol(i)) if strides[i] is None else ex.Num(strides[i])
        offset = ex.BinOp("+", offset, ex.BinOp("*", _slot_folded(idx), stride))
    return offset


def check_variant(v: Variant) -> list[tuple[str, str]]:
    """Layout problems of a variant's contract at its sizes, as (cache role, message)."""
    problems: list[tuple[str, str]] = []
    pages: dict[str, np.ndarray] = {}
    for cache in v.caches():
        role = cache.role
        syms = _symbols(v, cache)
        try:
            extents = _extents(cache, syms)
        except ZeroDivisionError as e:
            problems.append((role, f"shape: {e}"))
            continue
        bad = [str(cache.shape[i]) for i, e in enumerate(extents) if e is not None and e <= 0]
        if bad:
            problems.append((role, f"shape extent {bad[0]} is not positive at these sizes"))
            continue
        heads = 1 if role == "index" else v.num_kv_heads
        off, h, d = _page_grid(v.page_size(role), heads, _head_dim(v, cache))
        env = {**syms, "page": 0, "off": off, "h": h, "d": d}
        for i, idx in enumerate(cache.index):
            if i == cache.runtime_dim:
                continue
            try:
                val = ex.evaluate(_slot_folded(idx), env)
            except ZeroDivisionError as e:
                problems.append((role, f"index[{i}]: {e}"))
                break
            val = np.asarray(val)
            if bool((val < 0).any()) or bool((val >= extents[i]).any()):
                problems.append((role, f"index[{i}] '{idx}' leaves the extent "
                                 f"{extents[i]} of shape[{i}] '{cache.shape[i]}'"))
                break
        else:
            acc = ex.substitute(_plain_offset(cache, _strides(cache, extents)), syms)
            offs = _within_page(acc, cache, extents, (off, h, d)).ravel()
            if np.unique(offs).size != offs.size:
                problems.append((role, "two (slot, head, dim) elements land on the same address"))
            elif role != "index" and not {"page", "slot"} & {s for e in cache.index for s in e.symbols()}:
                problems.append((role, "never uses 'page' or 'slot'"))
            pages[role] = offs
    if (not problems and v.contract.combined_kv
            and bool(np.isin(pages["k"], pages["v"]).any())):
        problems.append(("v", "k and v share kv_cache but overlap"))
    return problems
