"""The op's signature as data: every argument of `kvforge::fused_qknorm_rope_cache`, once.

`ARGS` lists the op's arguments in the op's order. Each entry says what the argument is
(`Kind`), what validation asks of it (its dtype and shape rules, in the words of the
messages), which calls use it (`Use`: in the others it must be None, SPEC §7), where the
kernel reads it in the C ABI (a `CField` of `kvf_args_t`, or none: what is compiled into the
variant or only validated), the variant axis read from it, and its place and default in the
public function. `DERIVED` and `LAUNCH` are the ABI's fields that are no argument: the sizes
the arguments imply, and the tuned launch.

Derived from it: include/kvforge/abi.h (`python -m kvforge.codegen` writes it; `check`
reports it stale), its ctypes mirror (runtime/abi.py), the validated tensors the reference
and the launch read (runtime/reference.Tensors), validation's argument list and its
presence rules (runtime/validate.py), the torch.library schema, its mutated arguments and
the launch's argument vector and pointer offsets (runtime/api.py, runtime/dispatch.py), and
what the test inputs list (runtime/testing.py). The public function is written out by hand
(it is the documented API, and the eager call's hot path: a tuple of its parameters costs a
fraction of one built from `locals()`); tests/test_signature.py fails where it, or anything
derived, disagrees with this table.

Adding an argument is one entry here plus what computes it: an option that selects a variant
axis (`rope`) is an entry and its parameter in the public function; a tensor the kernel
reads adds a field to `kvf_args_t` (bump ABI_VERSION and ABI_LAYOUT: the test says so) and
its use in the kernel.

Plain Python, no torch: the code generator imports it.
"""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .model import IndexMode, Norm, Rope, StrictEnum
from .paths import INCLUDE

ABI_HEADER = INCLUDE / "kvforge" / "abi.h"
# The ABI's version: a library built against another one is refused at load, and a tuned
# launch table is read only by the version it was tuned for. ABI_LAYOUT pins the struct
# layout this version means (layout_digest()): a change of one without the other fails
# tests/test_signature.py.
ABI_VERSION = 9
# The version of what a tuned launch means (the LAUNCH fields, the defines they name, and the
# kernel schedule's reading of them): a tuned table (tuning/) is read only by the launch ABI it
# was tuned for. An ABI change that leaves the launch alone (an argument added) keeps the
# tables. LAUNCH_LAYOUT pins the fields and defines it means (launch_digest()).
LAUNCH_ABI = 8
LAUNCH_LAYOUT = "23f93c337004e9ec"
ABI_LAYOUT = "db9dc0eaa66b9392"


class Kind(enum.Enum):
    INPUT = "input"    # a tensor the call reads
    OUTPUT = "output"  # a tensor written whole; fused_qknorm_rope_cache allocates it when not passed
    CACHE = "cache"    # a tensor written in place at the tokens' slots
    INT = "int"
    FLOAT = "float"
    CHOICE = "choice"  # a str naming a value of a variant axis
    FLAG = "flag"      # a bool saying how the call runs, not what it computes: never validated,
                       # never part of a call's signature

    @property
    def tensor(self) -> bool:
        return self in (Kind.INPUT, Kind.OUTPUT, Kind.CACHE)

    @property
    def mutable(self) -> bool:
        return self in (Kind.OUTPUT, Kind.CACHE)

    @property
    def scalar_type(self) -> Optional[type]:
        """The Python type a scalar argument takes (None for a tensor)."""
        return {Kind.INT: int, Kind.FLOAT: float, Kind.CHOICE: str, Kind.FLAG: bool}.get(self)


class Use(enum.Enum):
    """Which calls an argument means something for; in the others it must be None (SPEC §7)."""

    ALWAYS = "every call"
    KV_APART = "contracts that keep K and V in two tensors"
    KV_TOGETHER = "contracts that keep K and V in one tensor"
    INDEX = "index_mode 'full'"
    KV_FP8 = "an FP8 KV cache at a given scale"
    KV_DYNAMIC = "an FP8 KV cache with per-token scales (per_token_head)"
    Q_FP8 = "an FP8 query output"


@dataclass(frozen=True)
class CField:
    """A member of a struct of the C ABI."""

    name: str
    ctype: str      # "const void*" and other pointers, int64_t, int32_t, float, kvf_cache_t, or T[N]
    note: str = ""  # the header's comment on it (lines separated by \n)

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def cache(self) -> bool:
        return self.ctype == "kvf_cache_t"

    @property
    def declaration(self) -> str:
        """`ctype name;`, with an array's extent after the name."""
        base, bracket, extent = self.ctype.partition("[")
        return f"{base} {self.name}{bracket}{extent};"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the public function has no default for it


@dataclass(frozen=True)
class Arg:
    """One argument of the op."""

    name: str
    kind: Kind
    dtype: str                # tensors: the dtype rule; scalars: the type
    shape: str                # tensors: the shape rule; scalars: the values allowed
    use: Use = Use.ALWAYS
    optional: str = ""        # where used, what None means ("": it must be passed)
    field: Optional[CField] = None  # where the kernel reads it (None: the variant holds it, or
                                    # only validation reads it)
    role: Optional[str] = None      # a cache: the contract's cache it fills (k, v, index)
    axis: Optional[str] = None      # the variant axis read from it (an unsupported signature names it)
    choices: Optional[type[StrictEnum]] = None  # CHOICE: its values (None: the contracts in force)
    default: Any = REQUIRED         # in the public function
    positional: bool = False        # positional-or-keyword in the public function (else keyword-only)

    @property
    def nullable(self) -> bool:
        """The op's schema takes None for it: some call does not use it."""
        return self.use is not Use.ALWAYS

    def annotation(self, tensor: type) -> Any:
        """Its type in the op's schema, `tensor` being the tensor type (torch.Tensor: this
        module does not import torch)."""
        if self.kind.tensor:
            return Optional[tensor] if self.nullable else tensor
        return self.kind.scalar_type


def _ptr(name: str, ctype: str = "const void*", note: str = "") -> CField:
    return CField(name, ctype, note)


_SLOTS = "[num_tokens] or shorter (tokens past it write no cache), contiguous"
_WEIGHT = "[head_dim] (the size of q_norm_weight), contiguous"
_OUT = ("[num_tokens, {h}, head_dim] or [num_tokens, {h} * head_dim]: rows of contiguous elements, the row stride "
        "a multiple of 16 bytes (a view of qkv writes in place)")
_CACHE = "the contract's {c} layout at this signature; free strides multiples of 16 bytes"
_KV_DTYPE = "the model dtype, or FP8 (float8_e4m3fn, float8_e4m3fnuz)"

ARGS: tuple[Arg, ...] = (
    Arg("qkv", Kind.INPUT, "bfloat16 or float16 (the model dtype)",
        "[num_tokens, row]: rows of contiguous elements, the row stride a multiple of 8",
        field=_ptr("qkv", note="[T, row] model dtype, row stride below"), axis="dtype", positional=True),
    Arg("positions", Kind.INPUT, "int64", "[num_tokens], contiguous",
        field=_ptr("positions", "const int64_t*", "[T]"), positional=True),
    Arg("cos_sin_cache", Kind.INPUT, "bfloat16, float16 or float32", "[max_pos, rotary_dim]: cos | sin, contiguous",
        field=_ptr("cos_sin", note="[max_pos, rotary_dim]: cos | sin"), axis="cos_sin", positional=True),
    Arg("slot_mapping", Kind.INPUT, "int64", _SLOTS,
        field=_ptr("slot_mapping", "const int64_t*", "[num_slots]"), positional=True),
    Arg("index_slot_mapping", Kind.INPUT, "int64", _SLOTS, Use.INDEX,
        optional="slot_mapping, where the contract shares the KV cache's slots",
        field=_ptr("index_slot_mapping", "const int64_t*", "[num_index_slots]"), default=None),
    Arg("k_cache", Kind.CACHE, _KV_DTYPE, _CACHE.format(c="K"), Use.KV_APART,
        field=CField("k_cache", "kvf_cache_t"), role="k", default=None, positional=True),
    Arg("v_cache", Kind.CACHE, "k_cache's", _CACHE.format(c="V"), Use.KV_APART,
        field=CField("v_cache", "kvf_cache_t"), role="v", default=None, positional=True),
    # K and V in one tensor: validation passes it to the kernel as k_cache and v_cache.
    Arg("kv_cache", Kind.CACHE, _KV_DTYPE, _CACHE.format(c="K/V"), Use.KV_TOGETHER, default=None),
    Arg("q_norm_weight", Kind.INPUT, "qkv's", "[head_dim], contiguous",
        field=_ptr("q_norm_weight"), axis="head_dim"),
    Arg("k_norm_weight", Kind.INPUT, "qkv's", _WEIGHT, field=_ptr("k_norm_weight")),
    Arg("index_q_norm_weight", Kind.INPUT, "qkv's", _WEIGHT, Use.INDEX,
        field=_ptr("index_q_norm_weight"), default=None),
    Arg("index_k_norm_weight", Kind.INPUT, "qkv's", _WEIGHT, Use.INDEX,
        field=_ptr("index_k_norm_weight"), default=None),
    Arg("index_cache", Kind.CACHE, "the model dtype, or FP8 (the KV cache's flavour)", _CACHE.format(c="index"),
        Use.INDEX, field=CField("index_cache", "kvf_cache_t"), role="index", axis="index_dtype", default=None),
    Arg("k_scale", Kind.INPUT, "float32", "[1] or [] (per tensor), or [num_kv_heads] (per kv head)", Use.KV_FP8,
        optional="a unit scale", field=_ptr("k_scale", "const float*", "[1] or [nkv] when the variant has one"),
        axis="kv_scale", default=None),
    Arg("v_scale", Kind.INPUT, "float32", "k_scale's granularity", Use.KV_FP8, optional="a unit scale",
        field=_ptr("v_scale", "const float*"), default=None),
    # Per-token scales: the kernel writes one fp32 per (slot, kv head) where the contract says.
    Arg("k_scale_cache", Kind.CACHE, "float32", _CACHE.format(c="K-scale"), Use.KV_DYNAMIC,
        field=CField("k_scale_cache", "kvf_cache_t"), role="k_scale", default=None),
    Arg("v_scale_cache", Kind.CACHE, "float32", _CACHE.format(c="V-scale"), Use.KV_DYNAMIC,
        field=CField("v_scale_cache", "kvf_cache_t"), role="v_scale", default=None),
    Arg("q_out", Kind.OUTPUT, "qkv's", _OUT.format(h="num_heads"),
        optional="not written, where q_fp8_out is given",
        field=_ptr("q_out", "void*", "[T, nq, D] rows, or null (q_fp8_out only)"), default=None),
    Arg("q_fp8_out", Kind.OUTPUT, "FP8 (the flavour of the FP8 caches)", _OUT.format(h="num_heads"), Use.Q_FP8,
        optional="no FP8 query output", field=_ptr("q_fp8_out", "void*", "[T, nq, D] rows: q / q_fp8_scale"),
        axis="q_fp8", default=None),
    Arg("q_fp8_scale", Kind.INPUT, "float32", "[1] or []", Use.Q_FP8,
        field=_ptr("q_fp8_scale", "const float*", "[1], with q_fp8_out"), default=None),
    # The rotated K and index_k beside their caches (vLLM's op writes them back into qkv).
    Arg("k_out", Kind.OUTPUT, "qkv's", _OUT.format(h="num_kv_heads"), optional="not written",
        field=_ptr("k_out", "void*", "[T, nkv, D] rows, or null"), default=None),
    Arg("index_q_out", Kind.OUTPUT, "index_cache's", _OUT.format(h="num_index_heads"), Use.INDEX,
        field=_ptr("index_q_out", "void*", "[T, niq, D] rows"), default=None),
    Arg("index_k_out", Kind.OUTPUT, "qkv's", _OUT.format(h="1"), Use.INDEX, optional="not written",  # [T, 1, D]
        field=_ptr("index_k_out", "void*", "[T, D] rows, or null"), default=None),
    Arg("num_heads", Kind.INT, "int", ">= 1", field=CField("num_heads", "int32_t")),
    Arg("num_kv_heads", Kind.INT, "int", ">= 1", axis="num_kv_heads"),
    Arg("num_index_heads", Kind.INT, "int", ">= 1 with index_mode 'full', >= 0 with 'skip', 0 with 'none'",
        field=CField("num_index_heads", "int32_t"), default=0),
    Arg("rotary_dim", Kind.INT, "int", "even, in [2, head_dim]", axis="rotary_dim"),
    Arg("eps", Kind.FLOAT, "float", "positive and finite", field=CField("eps", "float"), default=1e-6),
    Arg("contract", Kind.CHOICE, "str", "a contract of the variants files in force", axis="contract"),
    Arg("index_mode", Kind.CHOICE, "str", "full, skip or none", axis="index_mode", choices=IndexMode,
        default=IndexMode.FULL.value),
    Arg("norm", Kind.CHOICE, "str", "gemma or plain", axis="norm", choices=Norm, default=Norm.GEMMA.value),
    Arg("rope", Kind.CHOICE, "str", "neox or gptj", axis="rope", choices=Rope, default=Rope.NEOX.value),
    Arg("checked", Kind.FLAG, "bool", "True: every slot and position checked on the host (a sync)",
        default=False),
)

# The fields of kvf_args_t that are no argument. What computes each: runtime/api.py (_args).
DERIVED: tuple[CField, ...] = (
    CField("qkv_row_stride", "int64_t", "elements"),
    *(CField(f"{name}_row_stride", "int64_t", "elements (0 where it is null)")
      for name in ("q_out", "q_fp8_out", "k_out", "index_q_out", "index_k_out")),
    CField("max_pos", "int64_t"),
    CField("num_slots", "int64_t", "tokens past this write no K/V"),
    CField("num_index_slots", "int64_t"),
    CField("num_tokens", "int32_t"),
)
LAUNCH: tuple[CField, ...] = (  # the tuned launch (runtime/tuning.py's Launch)
    CField("pipeline_depth", "int32_t",
           "1..KVF_MAX_PIPELINE_DEPTH (0 = default): positions and slots\n"
           "are loaded this many tokens ahead, cos/sin one fewer;\n"
           "a call of one pass (a thread has one token) runs at 1"),
    CField("tokens_per_tile", "int32_t",
           "1, 2 .. KVF_MAX_TOKENS_PER_TILE (powers of two); 0 = default.\n"
           "A tile holds this many tokens times lanes_per_thread"),
    CField("v_loop", "int32_t", "KVF_V_LOOP_*; ignored where V is not transposed"),
    CField("lanes_per_thread", "int32_t",
           "1..KVF_MAX_LANES_PER_THREAD (0 = default), at most the\n"
           "variant's Traits::kMaxLanesPerThread; else the launch fails"),
    CField("kv_groups", "int32_t",
           "1, 2 .. KVF_MAX_KV_GROUPS (powers of two); 0 = default:\n"
           "groups each main-loop K/V head's tokens are dealt to in\n"
           "a call of several passes; read only by variants with\n"
           "per-token K/V scales"),
)
CACHE_FIELDS: tuple[CField, ...] = (  # kvf_cache_t
    CField("data", "void*"),
    CField("capacity", "int64_t", "slots the tensor holds (pages * page_size)"),
    CField("strides", "int64_t[KVF_MAX_DIMS]", "element strides; only the contract's free dims are read"),
)


@dataclass(frozen=True)
class Define:
    name: str
    value: int
    note: str = ""     # the comment after it (lines separated by \n)
    heading: str = ""  # a comment before it, on the group it opens


DEFINES: tuple[Define, ...] = (
    Define("KVF_ABI_VERSION", ABI_VERSION),
    Define("KVF_MAX_DIMS", 8),
    Define("KVF_MAX_PIPELINE_DEPTH", 2,
           "a library holds the main loop at depths 1..this (see pipeline_depth)"),
    Define("KVF_DEFAULT_PIPELINE_DEPTH", 1, "the depth a call naming 0 gets"),
    Define("KVF_MAX_TOKENS_PER_TILE", 4, "tokens whose head lanes a tile sets side by side: a power\nof two up to this"),
    Define("KVF_DEFAULT_TOKENS_PER_TILE", 2, "what a call naming 0 gets"),
    Define("KVF_MAX_LANES_PER_THREAD", 2, "head lanes (32 bytes of a head per token each) a main-loop\n"
                                          "thread holds: 1..this, where the variant has them"),
    Define("KVF_DEFAULT_LANES_PER_THREAD", 1, "what a call naming 0 gets"),
    Define("KVF_MAX_KV_GROUPS", 4, "groups of a K/V head taking turns at the passes' tokens:\n"
                                   "a power of two up to this"),
    Define("KVF_DEFAULT_KV_GROUPS", 2, "what a call naming 0 gets"),
    Define("KVF_V_LOOP_DEFAULT", 0, heading=(
        "Where a transposed V (SHUFFLE) is written: by the main loop's lanes of each token, or by\n"
        "the V loop that runs after it (tokens grouped into 16-byte runs). A call naming\n"
        "KVF_V_LOOP_DEFAULT gets the V loop from KVF_V_LOOP_MIN_TOKENS tokens on.")),
    Define("KVF_V_LOOP_OFF", 1),
    Define("KVF_V_LOOP_ON", 2),
    Define("KVF_V_LOOP_MIN_TOKENS", 256),
)

CALL_ARGS = tuple(a for a in ARGS if a.kind is not Kind.FLAG)  # what validation reads, in order
# (the flags come last, after it: tests/test_signature.py)
CALL_NAMES = tuple(a.name for a in CALL_ARGS)                  # the launch's argument vector
MUTABLE = tuple(a.name for a in ARGS if a.kind.mutable)        # what the op writes
KERNEL_ARGS = tuple(a for a in ARGS if a.field is not None)    # what the kernel reads of them


def args_fields() -> tuple[CField, ...]:
    """kvf_args_t in order: the arguments' data pointers, their caches, the sizes they imply,
    their scalars, the launch."""
    fields = [a.field for a in KERNEL_ARGS]
    return (*(f for f in fields if f.pointer), *(f for f in fields if f.cache), *DERIVED,
            *(f for f in fields if not f.pointer and not f.cache), *LAUNCH)


def layout_digest() -> str:
    """What the layout of both structs depends on (names, types, order), hashed."""
    text = "".join(f"{s}.{f.name}:{f.ctype};" for s, fields in (("kvf_cache_t", CACHE_FIELDS),
                                                               ("kvf_args_t", args_fields()))
                   for f in fields)
    dims = next(d.value for d in DEFINES if d.name == "KVF_MAX_DIMS")
    return hashlib.sha256(f"{text}KVF_MAX_DIMS={dims}".encode()).hexdigest()[:16]


def launch_digest() -> str:
    """What a tuned launch's fields are (names, types, order, and the defines), hashed."""
    text = "".join(f"{f.name}:{f.ctype};" for f in LAUNCH)
    text += "".join(f"{d.name}={d.value};" for d in DEFINES if d.name != "KVF_ABI_VERSION")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _commented(code: list[str], notes: list[str], indent: str = "", column: int = 0) -> list[str]:
    """Lines of code with their notes as comments aligned in one column (by default two past
    the longest line; a note's further lines under its first)."""
    column = column or max(len(c) for c in code) + 2
    out = []
    for c, note in zip(code, notes):
        first, *more = note.split("\n") if note else [""]
        out.append(f"{indent}{c}{' ' * (column - len(c))}// {first}" if first else f"{indent}{c}")
        out.extend(f"{indent}{' ' * column}// {line}" for line in more)
    return out


def _struct(name: str, fields: tuple[CField, ...]) -> list[str]:
    body = _commented([f.declaration for f in fields], [f.note for f in fields], indent="  ")
    return ["typedef struct {", *body, f"}} {name};"]


def abi_header() -> str:
    """include/kvforge/abi.h as this table makes it."""
    defines, column = [], max(len(f"#define {d.name} {d.value}") for d in DEFINES) + 2
    for d in DEFINES:
        if d.heading:
            defines.extend(f"// {line}" for line in d.heading.split("\n"))
        defines.extend(_commented([f"#define {d.name} {d.value}"], [d.note], column=column))
    lines = [
        "// Generated by `python -m kvforge.codegen` from codegen/signature.py; do not edit.",
        "// The plain C ABI between runtime/abi.py (ctypes) and every generated kernel library;",
        "// the loader refuses a library of another KVF_ABI_VERSION.",
        "#pragma once",
        "",
        "#include <stdint.h>",
        "",
        *defines,
        "",
        "#ifdef __cplusplus",
        'extern "C" {',
        "#endif",
        "",
        *_struct("kvf_cache_t", CACHE_FIELDS),
        "",
        *_struct("kvf_args_t", args_fields()),
        "",
        "#ifdef __cplusplus",
        "}",
        "#endif",
    ]
    return "\n".join(lines) + "\n"


def write_abi_header(path: Path = ABI_HEADER, dry_run: bool = False) -> bool:
    """Bring the header in line with the table, writing it only when its bytes change
    (the kernel cache's key hashes it). True if it was stale."""
    data = abi_header().encode()
    if path.exists() and path.read_bytes() == data:
        return False
    if not dry_run:
        tmp = path.with_suffix(".h.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return True
