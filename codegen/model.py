"""variants.yaml → validated, frozen spec objects.

Every schema problem becomes one line `variants.yaml:LINE: key.path: message`; all
of them are collected and raised together as `SpecError`. The objects returned are
frozen dataclasses and strict enums, so nothing downstream re-validates.
"""
from __future__ import annotations

import dataclasses
import enum
import fnmatch
import functools
import itertools
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import yaml

from . import expr as ex
from .yamlload import LocDict, LocList, load

__all__ = [
    "DType", "Fp8", "IndexMode", "IndexDtype", "KvScale", "Norm", "Saturation", "IndexSlots",
    "Rope", "QFp8", "Cache", "Contract", "Variant", "Family", "Spec", "SpecError", "parse_unchecked",
]


class SpecError(ValueError):
    """All problems found in one variants.yaml, one per line."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        count = f"{len(self.errors)} error{'s' if len(self.errors) != 1 else ''}"
        super().__init__(f"{count} in the variant spec:\n" + "\n".join(self.errors))


E = TypeVar("E", bound="StrictEnum")


class StrictEnum(enum.Enum):
    """An enum whose `parse` accepts exactly its spelled values."""

    @classmethod
    def parse(cls: type[E], value: Any) -> E:
        for member in cls:
            if member.value == value:
                return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"expected one of {choices}, got {value!r}")

    def __str__(self) -> str:
        return str(self.value)


class DType(StrictEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def size(self) -> int:
        return 4 if self is DType.FP32 else 2


class Fp8(StrictEnum):
    E4M3FN = "e4m3fn"
    E4M3FNUZ = "e4m3fnuz"

    @property
    def max(self) -> float:
        return 448.0 if self is Fp8.E4M3FN else 240.0


class IndexMode(StrictEnum):
    FULL = "full"
    SKIP = "skip"
    NONE = "none"


class IndexDtype(StrictEnum):
    MODEL = "model"
    FP8 = "fp8"


class KvScale(StrictEnum):
    NONE = "none"            # cache in the model dtype
    UNIT = "unit"            # FP8, scale 1
    PER_TENSOR = "per_tensor"
    PER_HEAD = "per_head"
    PER_TOKEN_HEAD = "per_token_head"  # amax / fp8_max per (token, kv head), into scale caches

    @property
    def dynamic(self) -> bool:
        """Scales the kernel computes (and writes into the contract's scale caches)."""
        return self is KvScale.PER_TOKEN_HEAD


class QFp8(StrictEnum):
    """The FP8 query output (q_fp8_out) beside or instead of q_out, at a device-scalar scale."""

    NONE = "none"
    PER_TENSOR = "per_tensor"


class Norm(StrictEnum):
    GEMMA = "gemma"          # x * rsqrt(ms + eps) * (1 + w)
    PLAIN = "plain"          # x * rsqrt(ms + eps) * w


class Rope(StrictEnum):
    NEOX = "neox"            # pairs (i, i + rotary_dim/2)
    GPTJ = "gptj"            # pairs (2i, 2i + 1), interleaved


class Saturation(StrictEnum):
    SATURATE = "saturate"
    PASSTHROUGH = "passthrough"


class IndexSlots(StrictEnum):
    OWN = "own"              # index_slot_mapping is required
    SHARED = "shared"        # index_slot_mapping defaults to slot_mapping


# Symbols a cache's shape and index expressions may use (`slot` = page * page_size + off).
COMPILE_TIME_SYMBOLS = frozenset({"D", "nkv", "x", "page_size"})
INDEX_SYMBOLS = frozenset({"page", "off", "slot", "h", "d"}) | COMPILE_TIME_SYMBOLS
RUNTIME_INDEX = ("page", "slot")  # what may index the run-time extent: it counts pages or slots
CACHE_TENSORS = ("k_cache", "v_cache", "kv_cache", "index_cache")
SCALE_TENSORS = ("k_scale_cache", "v_scale_cache")
# The caches a contract lists: K, V, the index cache, and the scale caches of per-token
# scales (one fp32 per slot and kv head; their page size is the KV cache's).
DATA_ROLES = ("k", "v", "index")
SCALE_ROLES = ("k_scale", "v_scale")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class Cache:
    """Where element (slot, head, dim) of one cache lands: data from the YAML."""

    role: str                     # k | v | index | k_scale | v_scale
    tensor: str                   # the API argument that holds it
    page_size: int                # the default; a scale cache: the KV cache's
    page_sizes: tuple[int, ...]   # the page sizes allowed (read from the tensor), sorted
    shape: tuple[ex.Expr, ...]
    index: tuple[ex.Expr, ...]
    free: tuple[int, ...]         # dims whose stride is read at run time
    runtime_dim: int              # the one dim whose extent is read from the tensor
    runtime_name: str

    @property
    def counts_slots(self) -> bool:
        """Whether the run-time extent counts slots (indexed by `slot`), not pages."""
        return self.index[self.runtime_dim] == ex.Sym("slot")


@dataclass(frozen=True)
class Contract:
    name: str
    engine: str
    scales: tuple[KvScale, ...]
    saturation: Saturation
    round_before_quant: bool
    index_slots: IndexSlots
    k: Cache
    v: Cache
    index: Cache
    k_scale: Cache | None         # per_token_head's scale caches (both or neither)
    v_scale: Cache | None
    line: int = field(compare=False, hash=False, default=0)
    source: str = field(compare=False, hash=False, default="variants.yaml")

    @property
    def combined_kv(self) -> bool:
        return self.k.tensor == self.v.tensor


@dataclass(frozen=True)
class Variant:
    """One compile-time point: everything the generated kernel bakes in."""

    contract: Contract
    dtype: DType
    head_dim: int
    rotary_dim: int
    num_kv_heads: int
    cos_sin: DType
    norm: Norm
    rope: Rope
    index_mode: IndexMode
    index_dtype: IndexDtype | None   # None unless index_mode is full
    kv_scale: KvScale
    fp8: Fp8 | None                  # None unless something is stored as FP8
    kv_page_size: int                # slots per page of K, V (and their scale caches)
    index_page_size: int             # of the index cache
    q_fp8: QFp8

    @property
    def kv_fp8(self) -> bool:
        return self.kv_scale is not KvScale.NONE

    def page_size(self, role: str) -> int:
        """The page size of one of the contract's caches (DATA_ROLES, SCALE_ROLES)."""
        return self.index_page_size if role == "index" else self.kv_page_size

    def caches(self) -> tuple[Cache, ...]:
        """The contract's caches this variant writes (scale caches with per-token scales)."""
        c = self.contract
        extra = (c.k_scale, c.v_scale) if self.kv_scale.dynamic else ()
        return (c.k, c.v, c.index, *extra)  # type: ignore[return-value]

    @property
    def index_fp8(self) -> bool:
        return self.index_dtype is IndexDtype.FP8

    @functools.cached_property
    def uri(self) -> str:
        """The procedural name: spells every compile-time parameter, C-identifier safe."""
        idx = self.index_mode.value
        if self.index_dtype is not None:
            idx += "_" + self.index_dtype.value
        kv = self.kv_scale.value.replace("_", "")
        parts = [
            self.contract.name, self.dtype.value, f"d{self.head_dim}", f"r{self.rotary_dim}",
            f"kvh{self.num_kv_heads}", f"cs{self.cos_sin.value}", self.norm.value,
            f"idx{idx}", f"kv{kv}",
        ]
        if self.rope is not Rope.NEOX:  # NeoX unspelled: the names of the libraries before the axis
            parts.insert(7, self.rope.value)
        # Axes added later are spelled where they differ from what names before them meant.
        if self.kv_page_size != self.contract.k.page_size:
            parts.append(f"kvp{self.kv_page_size}")
        if self.index_page_size != self.contract.index.page_size:
            parts.append(f"ip{self.index_page_size}")
        if self.q_fp8 is not QFp8.NONE:
            parts.append("qfp8")
        if self.fp8 is not None:
            parts.append(self.fp8.value)
        return "_".join(parts)

    def __hash__(self) -> int:
        # The name spells every field but the contract's body; hashing it instead of the
        # nested layout trees keeps dispatch lookups cheap.
        return hash(self.uri)

    def axes(self) -> dict[str, str]:
        """The variant as the YAML would write it (used in messages and manifests)."""
        out = {
            "contract": self.contract.name, "dtype": self.dtype.value,
            "head_dim": str(self.head_dim), "rotary_dim": str(self.rotary_dim),
            "num_kv_heads": str(self.num_kv_heads), "cos_sin": self.cos_sin.value,
            "norm": self.norm.value, "rope": self.rope.value, "index_mode": self.index_mode.value,
            "kv_scale": self.kv_scale.value,
        }
        if self.index_dtype is not None:
            out["index_dtype"] = self.index_dtype.value
        if self.fp8 is not None:
            out["fp8"] = self.fp8.value
        # The later axes where the name spells them (elsewhere they are what they were before them).
        if self.kv_page_size != self.contract.k.page_size:
            out["kv_page_size"] = str(self.kv_page_size)
        if self.index_page_size != self.contract.index.page_size:
            out["index_page_size"] = str(self.index_page_size)
        if self.q_fp8 is not QFp8.NONE:
            out["q_fp8"] = self.q_fp8.value
        return out


AXES = ("contract", "dtype", "head_dim", "rotary_dim", "num_kv_heads", "cos_sin", "norm",
        "rope", "index_mode", "index_dtype", "kv_scale", "fp8", "kv_page_size", "index_page_size", "q_fp8")


def select(variants, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> list[Variant]:
    """CUTLASS-style filters: the variants whose procedural name (uri) matches a glob of
    `include` (all, where it is empty) and none of `exclude`."""
    return [v for v in variants
            if (not include or any(fnmatch.fnmatch(v.uri, p) for p in include))
            and not any(fnmatch.fnmatch(v.uri, p) for p in exclude)]


@dataclass(frozen=True)
class Family:
    name: str
    line: int
    variants: tuple[Variant, ...]
    source: str = "variants.yaml"     # the file that lists it (an overlay's path as given)


@dataclass(frozen=True)
class Spec:
    contracts: Mapping[str, Contract]
    families: tuple[Family, ...]
    defaults: Mapping[str, str]
    variants: tuple[Variant, ...]     # sorted by uri, deduplicated

    def source_of(self, contract: str) -> str:
        """`file:line` where a contract is defined."""
        c = self.contracts[contract]
        return f"{c.source}:{c.line}"

    def variant(self, uri: str) -> Variant:
        for v in self.variants:
            if v.uri == uri:
                return v
        raise KeyError(uri)


# ----------------------------------------------------------------------------- errors
class _Errors:
    def __init__(self, filename: str):
        self.filename = filename
        self.items: list[str] = []

    def add(self, line: int, path: str, message: str) -> None:
        self.items.append(f"{self.filename}:{line}: {path}: {message}")


def _line_of(container: Any, key: Any, default: int) -> int:
    if isinstance(container, LocDict):
        return container.key_lines.get(key, default)
    if isinstance(container, LocList) and isinstance(key, int) and key < len(container.item_lines):
        return container.item_lines[key]
    return default


class _Section:
    """A mapping under validation: typed getters that report and never raise."""

    def __init__(self, errs: _Errors, data: Any, path: str, line: int, allowed: Sequence[str]):
        self.errs, self.path = errs, path
        self.ok = isinstance(data, dict)
        self.line = getattr(data, "line", line)
        self.data: dict = data if self.ok else {}
        if not self.ok:
            errs.add(line, path, f"expected a mapping, got {type(data).__name__}")
            return
        for key in data:
            if key not in allowed:
                errs.add(self.key_line(key), self.sub(key),
                         f"unknown key (allowed: {', '.join(allowed)})")

    def sub(self, key: Any) -> str:
        return f"{self.path}.{key}" if self.path else str(key)

    def key_line(self, key: Any) -> int:
        return _line_of(self.data, key, self.line)

    def get(self, key: str, parse: Callable[[Any], Any], required: bool = True,
            default: Any = None) -> Any:
        if key not in self.data:
            if required:
                self.errs.add(self.line, self.sub(key), "missing required key")
            return default
        try:
            return parse(self.data[key])
        except (ValueError, TypeError, ex.ExprError) as e:
            self.errs.add(self.key_line(key), self.sub(key), str(e))
            return default


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def _name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"expected a lower-case identifier, got {value!r}")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _pos_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return value


def _list_of(parse: Callable[[Any], Any]) -> Callable[[Any], tuple]:
    def inner(value: Any) -> tuple:
        if not isinstance(value, list) or not value:
            raise ValueError(f"expected a non-empty list, got {value!r}")
        return tuple(parse(v) for v in value)
    return inner


# ----------------------------------------------------------------------------- contracts
def _parse_cache(errs: _Errors, data: Any, path: str, line: int, role: str,
                 kv_pages: tuple[int, tuple[int, ...]] | None = None) -> Cache | None:
    """One cache of a contract. A scale cache (kv_pages given: the KV cache's default and
    allowed page sizes) takes the KV cache's page size and has no `d`."""
    scale = kv_pages is not None
    keys = ("tensor", "shape", "index", "free") if scale else ("tensor", "page_size", "page_sizes", "shape",
                                                               "index", "free")
    sec = _Section(errs, data, path, line, keys)
    if not sec.ok:
        return None
    n_before = len(errs.items)
    names = SCALE_TENSORS if scale else CACHE_TENSORS

    def tensor(v: Any) -> str:
        if v not in names:
            raise ValueError(f"expected one of {', '.join(names)}, got {v!r}")
        return v

    name = sec.get("tensor", tensor)
    if scale:
        page_size, page_sizes = kv_pages
    else:
        page_size = sec.get("page_size", _pos_int)
        page_sizes = sec.get("page_sizes", _list_of(_pos_int), required=False, default=None)
        if page_size is not None and page_sizes is not None and page_size not in page_sizes:
            errs.add(sec.key_line("page_sizes"), f"{path}.page_sizes",
                     f"must list the default page_size {page_size}")
        page_sizes = tuple(sorted(set(page_sizes or (page_size,))))
    shape_raw = sec.get("shape", _list_of(lambda v: v))
    index_raw = sec.get("index", _list_of(lambda v: v))
    free = sec.get("free", _list_of(_nonneg_int), required=False, default=())
    shape: list[ex.Expr] = []
    index: list[ex.Expr] = []
    runtime: list[tuple[int, str]] = []
    for i, text in enumerate(shape_raw or ()):
        try:
            e = ex.parse(text)
        except ex.ExprError as err:
            errs.add(_line_of(sec.data["shape"], i, sec.key_line("shape")), f"{path}.shape[{i}]", str(err))
            continue
        names_in = e.symbols() - COMPILE_TIME_SYMBOLS
        if names_in and not isinstance(e, ex.Sym):
            errs.add(_line_of(sec.data["shape"], i, sec.key_line("shape")), f"{path}.shape[{i}]",
                     f"a run-time extent must stand alone, got '{text}'")
        elif names_in:
            runtime.append((i, e.name))  # type: ignore[union-attr]
        shape.append(e)
    allowed = INDEX_SYMBOLS - {"d"} if scale else INDEX_SYMBOLS
    for i, text in enumerate(index_raw or ()):
        try:
            index.append(ex.parse(text, allowed))
        except ex.ExprError as err:
            errs.add(_line_of(sec.data["index"], i, sec.key_line("index")), f"{path}.index[{i}]", str(err))
    if len(errs.items) != n_before:
        return None
    if len(shape) != len(index):
        errs.add(sec.key_line("index"), f"{path}.index",
                 f"has {len(index)} entries but shape has {len(shape)}")
        return None
    if len(runtime) != 1:
        errs.add(sec.key_line("shape"), f"{path}.shape",
                 "needs exactly one run-time extent (the page count, e.g. 'pages', or the slot count), "
                 f"found {len(runtime)}")
        return None
    rdim, rname = runtime[0]
    if index[rdim] not in (ex.Sym("page"), ex.Sym("slot")):
        errs.add(sec.key_line("index"), f"{path}.index[{rdim}]",
                 f"the run-time dimension '{rname}' must be indexed by 'page' or 'slot', got '{index[rdim]}'")
        return None
    for d in free:
        if d >= len(shape):
            errs.add(sec.key_line("free"), f"{path}.free", f"dimension {d} does not exist "
                     f"(the shape has {len(shape)})")
            return None
        syms = index[d].symbols() - COMPILE_TIME_SYMBOLS
        if not (syms <= {"page"} or syms == {"slot"} or (syms == {"h"} and d < rdim)):
            errs.add(sec.key_line("free"), f"{path}.free",
                     f"dimension {d} is indexed by '{index[d]}'; only a dimension indexed by "
                     "'page' or 'slot', or by 'h' ahead of the run-time extent, may have a free stride")
            return None
    for d in range(len(shape)):
        if d < rdim and d not in free:
            errs.add(sec.key_line("shape"), f"{path}.shape",
                     f"dimension {d} lies outside the run-time extent '{rname}', so its stride "
                     "is not a constant; list it under 'free'")
            return None
    if role not in ("index",) and "h" not in set().union(*(e.symbols() for e in index)):
        errs.add(sec.key_line("index"), f"{path}.index", "never uses the head 'h'")
        return None
    return Cache(role=role, tensor=name, page_size=page_size, page_sizes=page_sizes, shape=tuple(shape),
                 index=tuple(index), free=tuple(sorted(set(free))), runtime_dim=rdim,
                 runtime_name=rname)


def _nonneg_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a dimension number, got {value!r}")
    return value


def _parse_contract(errs: _Errors, name: str, data: Any, line: int) -> Contract | None:
    path = f"contracts.{name}"
    sec = _Section(errs, data, path, line, ("engine", "scales", "saturation",
                                            "round_before_quant", "index_slots", "caches"))
    if not sec.ok:
        return None
    n_before = len(errs.items)
    if not _NAME.match(str(name)):
        errs.add(line, path, f"a contract name must be a lower-case identifier, got {name!r}")
    engine = sec.get("engine", _str)
    scales = sec.get("scales", _list_of(KvScale.parse))
    saturation = sec.get("saturation", Saturation.parse)
    rbq = sec.get("round_before_quant", _bool, required=False, default=True)
    slots = sec.get("index_slots", IndexSlots.parse)
    caches_sec = _Section(errs, sec.data.get("caches", LocDict()), f"{path}.caches",
                          sec.key_line("caches"), DATA_ROLES + SCALE_ROLES)
    if "caches" not in sec.data:
        errs.add(sec.line, f"{path}.caches", "missing required key")
    caches: dict[str, Cache | None] = {}
    for role in DATA_ROLES:
        if role not in caches_sec.data:
            if "caches" in sec.data:
                errs.add(caches_sec.line, f"{path}.caches.{role}", "missing required key")
            continue
        caches[role] = _parse_cache(errs, caches_sec.data[role], f"{path}.caches.{role}",
                                    caches_sec.key_line(role), role)
    k = caches.get("k")
    given = [r for r in SCALE_ROLES if r in caches_sec.data]
    if given and len(given) != len(SCALE_ROLES):
        missing = next(r for r in SCALE_ROLES if r not in given)
        errs.add(caches_sec.line, f"{path}.caches.{missing}",
                 f"missing required key (per-token scales need both {' and '.join(SCALE_ROLES)})")
    elif given and k:
        for role in SCALE_ROLES:
            caches[role] = _parse_cache(errs, caches_sec.data[role], f"{path}.caches.{role}",
                                        caches_sec.key_line(role), role, (k.page_size, k.page_sizes))
    if scales and (KvScale.PER_TOKEN_HEAD in scales) != bool(given):
        errs.add(sec.key_line("scales"), f"{path}.scales",
                 "per_token_head needs the scale caches k_scale and v_scale under caches"
                 if not given else "lists no per_token_head, so the scale caches mean nothing")
    if len(errs.items) != n_before:
        return None
    v, idx = caches["v"], caches["index"]
    assert k and v and idx
    kv_tensors = {k.tensor, v.tensor}
    if kv_tensors not in ({"k_cache", "v_cache"}, {"kv_cache"}) or k.tensor == "v_cache":
        errs.add(caches_sec.line, f"{path}.caches",
                 "k and v must live in k_cache and v_cache, or both in kv_cache; "
                 f"got {k.tensor} and {v.tensor}")
        return None
    if idx.tensor != "index_cache":
        errs.add(caches_sec.key_line("index"), f"{path}.caches.index.tensor",
                 f"expected index_cache, got {idx.tensor}")
        return None
    if k.tensor == v.tensor and (k.shape, k.page_size, k.page_sizes, k.free) != (v.shape, v.page_size, v.page_sizes,
                                                                                  v.free):
        errs.add(caches_sec.key_line("v"), f"{path}.caches.v",
                 "shares its tensor with k, so shape, page_size, page_sizes and free must match k's")
        return None
    if (k.page_size, k.page_sizes) != (v.page_size, v.page_sizes):
        errs.add(caches_sec.key_line("v"), f"{path}.caches.v.page_size",
                 f"k and v share slot_mapping, so page sizes must match ({k.page_size} vs {v.page_size}, "
                 f"allowed {list(k.page_sizes)} vs {list(v.page_sizes)})")
        return None
    return Contract(name=name, engine=engine, scales=scales, saturation=saturation,
                    round_before_quant=rbq, index_slots=slots, k=k, v=v, index=idx,
                    k_scale=caches.get("k_scale"), v_scale=caches.get("v_scale"), line=line, source=errs.filename)


# ----------------------------------------------------------------------------- variants
_FRACTION = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def _rotary(value: Any, head_dim: int) -> int:
    """`64` or a fraction of head_dim such as `1/2`."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number or a fraction like 1/2, got {value!r}")
    if isinstance(value, int):
        r = value
    else:
        m = _FRACTION.match(str(value))
        if not m or int(m.group(2)) == 0:
            raise ValueError(f"expected a number or a fraction like 1/2, got {value!r}")
        num, den = int(m.group(1)), int(m.group(2))
        if (head_dim * num) % den:
            raise ValueError(f"{value} of head_dim {head_dim} is not a whole number")
        r = head_dim * num // den
    if r <= 0 or r % 2 or r > head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {r}")
    return r


def _check_head_dim(value: Any) -> int:
    d = _pos_int(value)
    # One head is spread over D/8 lanes of 16 bytes; that group must fit a 32-lane warp.
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be one of 16, 32, 64, 128, 256, got {d}")
    return d


_DEFAULT_CHECKS: dict[str, Callable[[Any], Any]] = {
    "dtype": DType.parse, "head_dim": _check_head_dim,
    "rotary_dim": lambda v: _rotary(v, 256), "num_kv_heads": _pos_int,
    "cos_sin": lambda v: v if v == "model" else DType.parse(v), "norm": Norm.parse,
    "rope": Rope.parse, "index_mode": IndexMode.parse, "index_dtype": IndexDtype.parse, "kv_scale": KvScale.parse,
    "fp8": Fp8.parse, "kv_page_size": lambda v: _page_size(v, None), "index_page_size": lambda v: _page_size(v, None),
    "q_fp8": QFp8.parse,
}


def _page_size(value: Any, cache: Cache | None) -> int:
    """`contract` (the cache's default) or one of the page sizes the cache allows."""
    if value == "contract":
        return cache.page_size if cache else 0
    size = _pos_int(value)
    if cache and size not in cache.page_sizes:
        allowed = ", ".join(map(str, cache.page_sizes))
        raise ValueError(f"the {cache.role} cache ({cache.tensor}) allows page sizes {allowed}, not {size}")
    return size


# Axes added after version 1, with the value every file written before them meant: such a
# file still parses (its variants keep their names) without naming them in its defaults.
_LATER_AXES = {"rope": Rope.NEOX.value, "kv_page_size": "contract", "index_page_size": "contract",
               "q_fp8": QFp8.NONE.value}


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool) or value is None


def _check_axis_value(errs: _Errors, sec: _Section, key: str, path: str) -> bool:
    """An axis takes a value or a list of values (never a mapping); report otherwise."""
    if all(_is_scalar(v) for v in _axis_values(sec.data[key])):
        return True
    errs.add(sec.key_line(key), path, f"expected a value or a list of values, got {sec.data[key]!r}")
    return False


def _axis_values(value: Any) -> list:
    return list(value) if isinstance(value, list) else [value]


class PointError(ValueError):
    """One axis value that makes no variant; `axis` names it."""

    def __init__(self, axis: str, message: str):
        super().__init__(message)
        self.axis = axis


def make_variant(contracts: Mapping[str, Contract], p: Mapping[str, Any]) -> Variant:
    """Build one variant from axis values (YAML spellings); raises PointError.

    The runtime derives signatures through this same function, so a signature is
    servable exactly when the YAML could list it."""
    p = {**_LATER_AXES, **p}  # a point written before an axis existed means its old value

    def parse(axis: str, fn: Callable[[Any], Any]) -> Any:
        try:
            return fn(p[axis])
        except (ValueError, TypeError) as e:
            raise PointError(axis, str(e)) from None

    cname = p["contract"]
    if cname not in contracts:
        known = ", ".join(sorted(contracts)) or "none"
        raise PointError("contract", f"unknown contract {cname!r} (known: {known})")
    contract = contracts[cname]
    dtype = parse("dtype", DType.parse)
    if dtype is DType.FP32:
        raise PointError("dtype", "the model dtype must be bf16 or fp16")
    head_dim = parse("head_dim", _check_head_dim)
    rotary = parse("rotary_dim", lambda v: _rotary(v, head_dim))
    nkv = parse("num_kv_heads", _pos_int)
    cos_sin = parse("cos_sin", lambda v: dtype if v == "model" else DType.parse(v))
    norm = parse("norm", Norm.parse)
    rope = parse("rope", Rope.parse)
    mode = parse("index_mode", IndexMode.parse)
    idx_dtype = parse("index_dtype", IndexDtype.parse) if mode is IndexMode.FULL else None
    kv_scale = parse("kv_scale", KvScale.parse)
    if kv_scale not in contract.scales:
        allowed = ", ".join(s.value for s in contract.scales)
        raise PointError("kv_scale", f"contract {cname} allows kv_scale {allowed}, "
                          f"not {kv_scale.value}")
    q_fp8 = parse("q_fp8", QFp8.parse)
    uses_fp8 = kv_scale is not KvScale.NONE or idx_dtype is IndexDtype.FP8 or q_fp8 is not QFp8.NONE
    fp8 = parse("fp8", Fp8.parse) if uses_fp8 else None
    kv_pages = parse("kv_page_size", lambda x: _page_size(x, contract.k))
    index_pages = parse("index_page_size", lambda x: _page_size(x, contract.index))
    return Variant(contract=contract, dtype=dtype, head_dim=head_dim, rotary_dim=rotary,
                   num_kv_heads=nkv, cos_sin=cos_sin, norm=norm, rope=rope, index_mode=mode,
                   index_dtype=idx_dtype, kv_scale=kv_scale, fp8=fp8, kv_page_size=kv_pages,
                   index_page_size=index_pages, q_fp8=q_fp8)


def _matches(point: Mapping[str, Any], rule: Mapping[str, Any]) -> bool:
    return all(str(point.get(k)) in {str(v) for v in _axis_values(rule[k])} for k in rule)


def _parse_family(errs: _Errors, i: int, data: Any, line: int, defaults: Mapping[str, Any],
                  contracts: Mapping[str, Contract], broken: set[str]) -> Family | None:
    """Expand a family (product of its axes, minus excludes, plus includes) into variants.
    Points on a contract that failed to parse are skipped: its errors are already reported."""
    path = f"families[{i}]"
    n_before = len(errs.items)
    sec = _Section(errs, data, path, line, ("name", "axes", "exclude", "include"))
    if not sec.ok:
        return None
    name = sec.get("name", _name)
    if name:
        path = f"families.{name}"
        sec.path = path
    axes = _Section(errs, sec.data.get("axes", LocDict()), f"{path}.axes", sec.key_line("axes"), AXES)
    if "axes" not in sec.data:
        errs.add(sec.line, f"{path}.axes", "missing required key")
    for key, value in axes.data.items():
        if isinstance(value, list) and not value:
            errs.add(axes.key_line(key), f"{path}.axes.{key}", "an empty list selects nothing")
        else:
            _check_axis_value(errs, axes, key, f"{path}.axes.{key}")
    if "contract" not in axes.data and "axes" in sec.data:
        errs.add(axes.line, f"{path}.axes.contract", "missing required key")
    rules: dict[str, list[tuple[int, LocDict]]] = {}
    for kind in ("exclude", "include"):
        raw = sec.data.get(kind, [])
        if not isinstance(raw, list):
            errs.add(sec.key_line(kind), f"{path}.{kind}", "expected a list of axis mappings")
            continue
        rules[kind] = []
        for j, rule in enumerate(raw):
            rline = _line_of(raw, j, sec.key_line(kind))
            rsec = _Section(errs, rule, f"{path}.{kind}[{j}]", rline, AXES)
            valid = [_check_axis_value(errs, rsec, k, f"{path}.{kind}[{j}].{k}") for k in rsec.data]
            if rsec.ok and all(valid):
                rules[kind].append((rline, rule))
    if len(errs.items) > n_before:  # the family's own shape is wrong: expanding it would mislead
        return None

    def product(fixed: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        names = list(AXES)
        values = [_axis_values(fixed[n]) if n in fixed else _axis_values(defaults[n])
                  for n in names]
        for combo in itertools.product(*values):
            yield dict(zip(names, combo))

    points: list[tuple[dict[str, Any], int, str]] = []
    for p in product(axes.data):
        if not any(_matches(p, r) for _, r in rules["exclude"]):
            points.append((p, sec.line, "axes"))
    for j, (rline, rule) in enumerate(rules["include"]):
        for p in product({**axes.data, **rule}):
            points.append((p, rline, f"include[{j}]"))

    variants: dict[str, Variant] = {}
    reported: set[tuple[str, str]] = set()
    skipped = 0
    for p, pline, where in points:
        if p["contract"] in broken:
            skipped += 1
            continue
        try:
            v = make_variant(contracts, p)
        except PointError as e:
            src = axes if where == "axes" else None
            eline = src.key_line(e.axis) if src and e.axis in src.data else pline
            if (e.axis, str(e)) not in reported:  # includes inherit the axes: say it once
                reported.add((e.axis, str(e)))
                errs.add(eline, f"{path}.{where}.{e.axis}", f"{e} (exclude it or change the axis)")
            continue
        variants[v.uri] = v
    if not variants and not reported and not skipped:
        errs.add(sec.line, path, "selects no variant (every combination is excluded)")
    return Family(name=name or f"#{i}", line=sec.line, variants=tuple(sorted(variants.values(), key=lambda v: v.uri)))


def _load_document(text: str, filename: str) -> LocDict:
    try:
        data = load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 0
        raise SpecError([f"{filename}:{line}: {e.problem or e.context}"]) from None
    except yaml.YAMLError as e:  # e.g. a character YAML cannot read: no line to give
        raise SpecError([f"{filename}: {e}"]) from None
    return data if data is not None else LocDict()


def _parse_defaults(errs: _Errors, top: _Section, base: Mapping[str, Any] | None) -> dict | None:
    """The document's defaults: every axis for the shipped file; for an overlay, any
    subset, laid over the shipped ones for that file's families. None when broken."""
    n_before = len(errs.items)
    sec = _Section(errs, top.data.get("defaults", LocDict()), "defaults",
                   top.key_line("defaults"), [a for a in AXES if a != "contract"])
    for axis in AXES:
        if axis == "contract":
            continue
        if base is None and axis not in sec.data and axis not in _LATER_AXES and "defaults" in top.data:
            errs.add(sec.line, f"defaults.{axis}", "missing required key")
        if isinstance(sec.data.get(axis), list):
            errs.add(sec.key_line(axis), f"defaults.{axis}", "a default is one value, not a list")
        elif axis in sec.data:
            sec.get(axis, _DEFAULT_CHECKS[axis])
    if not sec.ok or len(errs.items) > n_before:
        return None
    return {**(_LATER_AXES if base is None else base), **sec.data}


def _parse_document(errs: _Errors, data: Any, base: Spec | None) -> tuple[dict, list[Family], dict] | None:
    """One YAML document's contracts, families and defaults. `base` is the spec an overlay
    adds to: its contracts may be used, not redefined; its defaults fill the overlay's."""
    top = _Section(errs, data, "", 1, ("version", "defaults", "contracts", "families"))
    if not top.ok:
        return None
    version = top.get("version", _pos_int, required=base is None)
    if version not in (None, 1):
        errs.add(top.key_line("version"), "version", f"this generator reads version 1, got {version}")
    if base is None:
        for key in ("defaults", "contracts", "families"):
            if key not in top.data:
                errs.add(1, key, "missing required key")
    defaults = _parse_defaults(errs, top, base.defaults if base else None)
    known = dict(base.contracts) if base else {}
    contracts: dict[str, Contract] = {}
    csec = _Section(errs, top.data.get("contracts", LocDict()), "contracts",
                    top.key_line("contracts"), list(top.data.get("contracts") or {}))
    broken: set[str] = set()
    for name, body in csec.data.items():
        if name in known:
            errs.add(csec.key_line(name), f"contracts.{name}",
                     f"already defined by {base.source_of(name)}; give the new layout its own name")
            broken.add(name)
            continue
        c = _parse_contract(errs, name, body, csec.key_line(name))
        if c:
            contracts[name] = c
        else:
            broken.add(name)
    raw_families = top.data.get("families", [])
    if not isinstance(raw_families, list):
        errs.add(top.key_line("families"), "families", "expected a list of families")
        raw_families = []
    if defaults is None or (base is None and "defaults" not in top.data):
        return None  # every family point would repeat a defaults error
    families: list[Family] = []
    seen_names = {f.name: f"{f.source}:{f.line}" for f in base.families} if base else {}
    for i, body in enumerate(raw_families):
        fam = _parse_family(errs, i, body, _line_of(raw_families, i, top.line),
                            {**defaults, "contract": None}, {**known, **contracts}, broken)
        if fam:
            if fam.name in seen_names:
                errs.add(fam.line, f"families.{fam.name}",
                         f"duplicate family name (first at {seen_names[fam.name]})")
            seen_names[fam.name] = f"{errs.filename}:{fam.line}"
            families.append(fam)
    return contracts, families, defaults


def parse_unchecked(text: str, filename: str = "variants.yaml", base: Spec | None = None) -> Spec:
    """Parse one variants file; with `base`, as an overlay whose contracts and families are
    added to base's. Its layouts are not yet proven: codegen.load does that (parse_spec)."""
    errs = _Errors(filename)
    parsed = _parse_document(errs, _load_document(text, filename), base)
    if errs.items or parsed is None:
        raise SpecError(errs.items)
    contracts, families, defaults = parsed
    families = [dataclasses.replace(f, source=filename) for f in families]
    if base is not None:
        contracts = {**base.contracts, **contracts}
        families = [*base.families, *families]
        defaults = base.defaults
    unique = {v.uri: v for fam in families for v in fam.variants}
    return Spec(contracts=contracts, families=tuple(families), defaults=defaults,
                variants=tuple(unique[u] for u in sorted(unique)))
