"""SPEC §7 as a table: one bad input per row, each over a valid call of some contract.

Every row changes one thing (or the few things one mistake changes together) in valid
arguments built by `make_inputs` + `with_outputs`, and asserts: a ValueError/TypeError of
exactly that class (no raw torch error, none chained visibly), whose message has the form
`ARG: expected WHAT, got GIVEN` (or `ARG: unsupported signature: AXIS: ...`), blames the
row's argument, matches the row's pattern (built from the spec and the row's values, not
from today's list of contracts) and names the argument the row changed; and every tensor
of the call (inputs, outputs, caches) is byte-for-byte unchanged afterwards. Rows run with
the outputs passed and, where they do not change an output, with the outputs left to the
API to allocate (the path on which bad head counts once raised torch's own errors).

Decisions the table pins beside the errors (see also the tests after it):
* a call with 0 tokens (qkv [0, row], empty positions and slots) is legal and writes nothing;
* an empty slot_mapping is legal (tokens past it write no cache, SPEC §1);
* an empty cache, norm weight, cos_sin_cache or scale is an error; a 0-D scale is a per-tensor one;
* an argument that means nothing for the call is an error: a scale for a model-dtype cache,
  any index tensor in 'skip' or 'none' mode, num_index_heads != 0 in 'none' mode, k_cache /
  v_cache for a one-tensor contract and kv_cache for a two-tensor one.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import pytest
import torch

from kvforge.codegen.layout import access
from kvforge.codegen.model import IndexMode, Norm, Rope
from kvforge.runtime import fused_qknorm_rope_cache, minimax_m3_qknorm_rope_cache_shuffle_insert
from kvforge.runtime.registry import spec
from kvforge.runtime.testing import make_inputs, with_outputs

SPEC = spec()
X = re.escape
FORM = re.compile(r"(?P<arg>[a-z_0-9]+): (expected .+, got .+|unsupported signature: [a-z_0-9]+: .+)", re.S)
OUTPUTS = ("q_out", "index_q_out")


def variant(**axes):
    return next(v for v in SPEC.variants if all(v.axes().get(k) == str(x) for k, x in axes.items()))


VARIANTS = {
    "shuffle": variant(contract="vllm_shuffle16", index_mode="full", num_kv_heads=4, kv_scale="none",
                       index_dtype="model", head_dim=128, rotary_dim=64, dtype="bf16", norm="gemma", rope="neox"),
    "shuffle_fp8": variant(contract="vllm_shuffle16", index_mode="full", num_kv_heads=4,
                           kv_scale="per_tensor", index_dtype="fp8", fp8="e4m3fnuz", head_dim=128),
    "sglang": variant(contract="sglang_nhd", num_kv_heads=4, kv_scale="unit", index_dtype="model",
                      cos_sin="fp32"),
    "nhd": variant(contract="vllm_nhd", num_kv_heads=4, kv_scale="per_head", index_dtype="fp8"),
    "m3": variant(contract="vllm_m3", num_kv_heads=4, kv_scale="none", index_dtype="model", rotary_dim=64),
    "skip": variant(contract="vllm_shuffle16", index_mode="skip", num_kv_heads=4, kv_scale="none"),
    "none": variant(contract="vllm_shuffle16", index_mode="none", num_kv_heads=4, kv_scale="none"),
    "pertoken": variant(contract="vllm_shuffle16", num_kv_heads=4, kv_scale="per_token_head", fp8="e4m3fn"),
    "aiter": variant(contract="aiter_nhd", num_kv_heads=4, kv_scale="per_token_head"),
    "qfp8": variant(contract="vllm_shuffle16", num_kv_heads=4, q_fp8="per_tensor", kv_scale="none"),
}
T, NQ, NIQ = 6, 4, 2


def base_args(name: str) -> dict:
    v = VARIANTS[name]
    return with_outputs(make_inputs(v, T, NQ, 0 if v.index_mode is IndexMode.NONE else NIQ, seed=3))


BASES = {name: base_args(name) for name in VARIANTS}


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    base: str
    exc: type
    blame: str     # the argument the message starts with
    pattern: str   # regex of the rest of the message, after "BLAME: "
    changes: dict  # argument -> value, or a function of the valid arguments giving it
    names: tuple   # names the message must contain (default: the first argument changed)


def row(id, base, exc, blame, pattern, names=None, **changes) -> Row:
    names = tuple(changes)[:1] if names is None else names
    return Row(id, base, exc, blame, pattern, changes, names)


def expect(what: str, got: str) -> str:
    return f"expected {what}, got {got}"


def tensor_of(dtype, shape) -> str:
    return X(f"a {str(dtype).removeprefix('torch.')} tensor of shape {tuple(shape)}")


def shape_of(name: str, role: str, got) -> str:
    """The message of a cache whose shape the contract does not allow, from the contract
    (`got`: the shape given, None where any number of pages)."""
    v = VARIANTS[name]
    runtime = getattr(v.contract, role).runtime_name
    dims = ", ".join(runtime if e is None else str(e) for e in access(v, role).extents)
    given = X(str(tuple(-1 if s is None else s for s in got))).replace("\\-1", r"\d+")
    cache = getattr(v.contract, role)
    sizes = ""
    if len(cache.page_sizes) > 1:  # the page size is read from the shape: the message says which it may be
        sizes = f" (page size {v.page_size(role)}; the contract allows {', '.join(map(str, cache.page_sizes))})"
    return X(f"expected shape [{dims}] for contract {v.contract.name} with this signature{sizes}, got ") + given


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values at an address 2 bytes past a 16-byte boundary, same shape and strides."""
    flat = torch.empty(t.numel() * t.element_size() + 32, dtype=torch.uint8)
    off = (-flat.data_ptr()) % 16 + 2
    return flat[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def odd_page_stride(t: torch.Tensor) -> torch.Tensor:
    """t with a page stride one element (one byte for FP8) longer than its page."""
    page = t[0].numel()
    return torch.empty(t.shape[0], page + 1, dtype=t.dtype)[:, :page].view(t.shape)


def _with_head_dim(d: int) -> Callable[[dict], dict]:
    return lambda a: torch.randn(T, (NQ + 8 + NIQ + 1) * d).to(torch.bfloat16)


META = torch.device("meta")
CONTRACTS = ", ".join(sorted(SPEC.contracts))
NORMS = ", ".join(repr(n.value) for n in Norm)
ROPES = ", ".join(repr(r.value) for r in Rope)
MODES = ", ".join(repr(m.value) for m in IndexMode)
KV_DTYPES = "dtype bfloat16, float8_e4m3fn, float8_e4m3fnuz"
SHUFFLE, SGLANG = VARIANTS["shuffle"].contract, VARIANTS["sglang"].contract
ROW = (NQ + 8 + NIQ + 1) * 128  # 15 heads of 128
POS_INT = "a positive integer"
RDIM = X("an even number in [2, head_dim=128]")
SCALE_SHAPE = X("shape (1,) or () (per tensor) or (4,) (per kv head)")
ROWS_OF = "rows of contiguous elements whose row stride is a multiple of 16 bytes"
NO_SCALE = "{} is bfloat16: a model-dtype cache takes no scale"
ALLOCATED = X("a tensor (an output the kernel writes; fused_qknorm_rope_cache allocates it when not passed)")


def allows(contract, *, got: str) -> str:
    return X(f"kv_scale: contract {contract.name} allows kv_scale "
             f"{', '.join(s.value for s in contract.scales)}, not {got}")


ROWS = [
    # ---- qkv
    row("qkv-dtype", "shuffle", TypeError, "qkv", expect("dtype bfloat16, float16", "float32"),
        qkv=lambda a: a["qkv"].float()),
    row("qkv-0d", "shuffle", ValueError, "qkv", expect(X("a 2-D tensor [num_tokens, row]"), X("shape ()")),
        qkv=torch.tensor(1.0, dtype=torch.bfloat16)),
    row("qkv-rank", "m3", ValueError, "qkv", expect(X("a 2-D tensor [num_tokens, row]"), X(f"shape ({T}, 1, {ROW})")),
        qkv=lambda a: a["qkv"][:, None]),
    row("qkv-stride", "shuffle", ValueError, "qkv",
        expect("rows of contiguous elements whose row stride is a multiple of 8", X(f"strides (1, {T})")),
        qkv=lambda a: a["qkv"].t().contiguous().t()),
    row("qkv-device", "sglang", ValueError, "qkv", expect(X("a tensor on a GPU (cuda) or on the cpu"), "meta"),
        qkv=lambda a: a["qkv"].to(META)),
    row("qkv-not-tensor", "nhd", TypeError, "qkv", expect("a torch.Tensor", r"\[\[.*\(list\)"),
        qkv=lambda a: a["qkv"][:1, :4].tolist()),
    row("qkv-empty-row", "shuffle", ValueError, "qkv", expect(f"rows of {ROW} elements .*", "rows of 0"),
        qkv=torch.empty(T, 0, dtype=torch.bfloat16)),
    row("qkv-misaligned", "shuffle", ValueError, "qkv", expect("a 16-byte aligned data pointer .*", "address 0x[0-9a-f]+"),
        qkv=lambda a: misaligned(a["qkv"])),
    row("qkv-sparse", "m3", ValueError, "qkv", expect(X("a dense (strided) tensor"), "layout torch.sparse_coo"),
        qkv=lambda a: a["qkv"].to_sparse()),
    # ---- head counts (they fix the row's layout)
    row("num_heads-negative", "shuffle", ValueError, "num_heads", expect(POS_INT, "-1"), num_heads=-1),
    row("num_heads-zero", "shuffle", ValueError, "num_heads", expect(POS_INT, "0"), num_heads=0),
    row("num_heads-float", "sglang", TypeError, "num_heads", expect(POS_INT, X("4.0 (float)")), num_heads=4.0),
    row("num_heads-row", "shuffle", ValueError, "qkv",
        expect(X(f"rows of {16 * 128} elements (num_heads=5 + 2*num_kv_heads=4 + num_index_heads=2 + 1 index_k "
                 f"head = 16 heads of head_dim 128, index_mode full)"), f"rows of {ROW}"), num_heads=5),
    row("num_kv_heads-zero", "m3", ValueError, "num_kv_heads", expect(POS_INT, "0"), num_kv_heads=0),
    row("num_kv_heads-str", "nhd", TypeError, "num_kv_heads", expect(POS_INT, X("'4' (str)")), num_kv_heads="4"),
    row("num_kv_heads-bool", "shuffle", TypeError, "num_kv_heads", expect(POS_INT, X("True (bool)")),
        num_kv_heads=True),
    row("num_kv_heads-row", "sglang", ValueError, "qkv",
        expect(f"rows of {17 * 128} elements .*2\\*num_kv_heads=5 .*", f"rows of {ROW}"), num_kv_heads=5),
    row("num_index_heads-negative", "shuffle", ValueError, "num_index_heads",
        expect(X("a positive integer (index_mode 'full' has index heads)"), "-1"), num_index_heads=-1),
    row("num_index_heads-zero-full", "nhd", ValueError, "num_index_heads",
        expect(X("a positive integer (index_mode 'full' has index heads)"), "0"), num_index_heads=0),
    row("num_index_heads-none-mode", "none", ValueError, "num_index_heads",
        expect(X("0 (index_mode 'none': rows hold no index heads)"), "2"), num_index_heads=2),
    row("num_index_heads-skip-negative", "skip", ValueError, "num_index_heads",
        expect("a non-negative integer", "-1"), num_index_heads=-1),
    row("num_index_heads-none-type", "m3", TypeError, "num_index_heads",
        expect(X("a positive integer (index_mode 'full' has index heads)"), "None"), num_index_heads=None),
    # ---- rotary_dim, eps
    row("rotary_dim-odd", "shuffle", ValueError, "rotary_dim", expect(RDIM, "63"), rotary_dim=63),
    row("rotary_dim-above-D", "shuffle", ValueError, "rotary_dim", expect(RDIM, "130"), rotary_dim=130),
    row("rotary_dim-zero", "m3", ValueError, "rotary_dim", expect(RDIM, "0"), rotary_dim=0),
    row("rotary_dim-float", "sglang", TypeError, "rotary_dim",
        expect(X("an even number in [2, head_dim]"), X("64.0 (float)")), rotary_dim=64.0),
    row("eps-zero", "shuffle", ValueError, "eps", expect("a positive finite float", "0.0"), eps=0.0),
    row("eps-negative", "skip", ValueError, "eps", expect("a positive finite float", "-1e-06"), eps=-1e-6),
    row("eps-nan", "nhd", ValueError, "eps", expect("a positive finite float", "nan"), eps=float("nan")),
    row("eps-inf", "none", ValueError, "eps", expect("a positive finite float", "inf"), eps=float("inf")),
    row("eps-str", "m3", TypeError, "eps", expect("a positive float", X("'1e-6' (str)")), eps="1e-6"),
    row("eps-none", "shuffle", TypeError, "eps", expect("a positive float", "None"), eps=None),
    # ---- contract, index_mode, norm
    row("contract-unknown", "shuffle", ValueError, "contract", expect(X(f"one of {CONTRACTS}"), "'trtllm'"),
        contract="trtllm"),
    row("contract-type", "sglang", TypeError, "contract", expect(X(f"one of {CONTRACTS} (a str)"), "None"),
        contract=None),
    row("contract-other-layout", "shuffle", ValueError, "k_cache",
        expect(X("None (contract vllm_m3 stores K and V in one tensor, kv_cache)"), "a bfloat16 tensor .*"),
        names=("contract", "k_cache"), contract="vllm_m3"),
    row("index_mode-unknown", "shuffle", ValueError, "index_mode", expect(X(f"one of {MODES}"), "'sparse'"),
        index_mode="sparse"),
    row("index_mode-type", "m3", TypeError, "index_mode", expect(X(f"one of {MODES} (a str)"), X("1 (int)")),
        index_mode=1),
    row("index_mode-none-with-full-rows", "shuffle", ValueError, "num_index_heads",
        expect(X("0 (index_mode 'none': rows hold no index heads)"), "2"), names=("index_mode", "num_index_heads"),
        index_mode="none"),
    row("norm-unknown", "shuffle", ValueError, "norm", expect(X(f"one of {NORMS}"), "'layer'"), norm="layer"),
    row("norm-type", "nhd", TypeError, "norm", expect(X(f"one of {NORMS} (a str)"), "None"), norm=None),
    row("rope-unknown", "shuffle", ValueError, "rope", expect(X(f"one of {ROPES}"), "'yarn'"), rope="yarn"),
    row("rope-type", "m3", TypeError, "rope", expect(X(f"one of {ROPES} (a str)"), X("True (bool)")), rope=True),
    # ---- positions
    row("positions-dtype", "shuffle", TypeError, "positions", expect("dtype int64", "int32"),
        positions=lambda a: a["positions"].int()),
    row("positions-device", "shuffle", ValueError, "positions", expect(X("a tensor on cpu (where qkv is)"), "meta"),
        positions=lambda a: a["positions"].to(META)),
    row("positions-0d", "sglang", ValueError, "positions", expect(X("a 1-D tensor [num_tokens]"), X("shape ()")),
        positions=torch.tensor(3)),
    row("positions-short", "m3", ValueError, "positions", expect(X(f"{T} entries (one per qkv row)"), f"{T - 1}"),
        positions=lambda a: a["positions"][:T - 1]),
    row("positions-empty", "skip", ValueError, "positions", expect(X(f"{T} entries (one per qkv row)"), "0"),
        positions=torch.empty(0, dtype=torch.int64)),
    row("positions-stride", "nhd", ValueError, "positions", expect("a contiguous tensor", X("strides (2,)")),
        positions=torch.arange(2 * T)[::2]),
    row("positions-none", "none", TypeError, "positions", expect("a torch.Tensor", "None"), positions=None),
    # ---- cos_sin_cache
    row("cos_sin-dtype", "shuffle", TypeError, "cos_sin_cache", expect("dtype bfloat16, float16, float32", "int64"),
        cos_sin_cache=lambda a: a["cos_sin_cache"].long()),
    row("cos_sin-width", "shuffle", ValueError, "cos_sin_cache",
        expect(X("shape [max_pos, rotary_dim=64]"), X("(4096, 32)")), cos_sin_cache=lambda a: a["cos_sin_cache"][:, :32]),
    row("cos_sin-empty", "sglang", ValueError, "cos_sin_cache", expect(X("at least one row (position)"), X("shape (0, 64)")),
        cos_sin_cache=lambda a: a["cos_sin_cache"][:0]),
    row("cos_sin-0d", "m3", ValueError, "cos_sin_cache", expect(X("shape [max_pos, rotary_dim=64]"), X("()")),
        cos_sin_cache=torch.tensor(0.5, dtype=torch.bfloat16)),
    row("cos_sin-stride", "nhd", ValueError, "cos_sin_cache", expect("a contiguous tensor", X("strides (1, 4096)")),
        cos_sin_cache=lambda a: a["cos_sin_cache"].t().contiguous().t()),
    row("cos_sin-device", "skip", ValueError, "cos_sin_cache", expect(X("a tensor on cpu (where qkv is)"), "meta"),
        cos_sin_cache=lambda a: a["cos_sin_cache"].to(META)),
    # ---- slot mappings
    row("slot_mapping-dtype", "shuffle", TypeError, "slot_mapping", expect("dtype int64", "int32"),
        slot_mapping=lambda a: a["slot_mapping"].int()),
    row("slot_mapping-long", "shuffle", ValueError, "slot_mapping",
        expect(f"at most num_tokens={T} entries", f"{T + 1}"), slot_mapping=torch.zeros(T + 1, dtype=torch.int64)),
    row("slot_mapping-2d", "m3", ValueError, "slot_mapping", expect(X("a 1-D tensor [num_tokens]"), X(f"shape ({T}, 1)")),
        slot_mapping=lambda a: a["slot_mapping"][:, None]),
    row("slot_mapping-device", "sglang", ValueError, "slot_mapping", expect(X("a tensor on cpu (where qkv is)"), "meta"),
        slot_mapping=lambda a: a["slot_mapping"].to(META)),
    row("slot_mapping-0d", "nhd", ValueError, "slot_mapping", expect(X("a 1-D tensor [num_tokens]"), X("shape ()")),
        slot_mapping=torch.tensor(0)),
    row("index_slot_mapping-missing", "shuffle", ValueError, "index_slot_mapping",
        expect(X(f"a tensor (contract {SHUFFLE.name} has its own index slots)"), "None"), index_slot_mapping=None),
    row("index_slot_mapping-long", "nhd", ValueError, "index_slot_mapping",
        expect(f"at most num_tokens={T} entries", f"{T + 1}"), index_slot_mapping=torch.zeros(T + 1, dtype=torch.int64)),
    row("index_slot_mapping-float", "m3", TypeError, "index_slot_mapping", expect("dtype int64", "float32"),
        index_slot_mapping=lambda a: a["slot_mapping"].float()),
    # ---- the K/V caches
    row("k_cache-missing", "shuffle", ValueError, "k_cache",
        expect(X(f"a tensor (contract {SHUFFLE.name} keeps K and V in two tensors)"), "None"), k_cache=None),
    row("v_cache-dtype", "shuffle", TypeError, "v_cache", expect(X("dtype bfloat16 (the dtype of k_cache)"), "float16"),
        v_cache=lambda a: a["v_cache"].half()),
    row("k_cache-dtype", "sglang", TypeError, "k_cache", expect(KV_DTYPES, "float32"),
        k_cache=lambda a: a["k_cache"].float(), v_cache=lambda a: a["v_cache"].float()),
    row("k_cache-shape", "shuffle", ValueError, "k_cache",
        shape_of("shuffle", "k", (None, 4, 16, 16, 4)), k_cache=lambda a: a["k_cache"][..., :4]),
    row("k_cache-too-small", "sglang", ValueError, "k_cache",
        shape_of("sglang", "k", (None, 2, 128)),
        k_cache=lambda a: a["k_cache"][:, :2]),
    row("v_cache-stride", "shuffle", ValueError, "v_cache",
        expect(X(f"stride 2048 in dimension 1 (contiguous, as contract {SHUFFLE.name} lays it out)"), r"strides \(.*\)"),
        v_cache=lambda a: a["v_cache"].transpose(1, 2).contiguous().transpose(1, 2)),
    row("k_cache-no-page", "shuffle", ValueError, "k_cache",
        expect(X("a cache of at least one page (pages >= 1)"), X("shape (0, 4, 16, 16, 8)")),
        k_cache=lambda a: a["k_cache"][:0], v_cache=lambda a: a["v_cache"][:0]),
    row("k_cache-page-stride", "nhd", ValueError, "k_cache",
        expect("the stride of dimension 0 to be a multiple of 16 bytes", X("strides (8193, 512, 128, 1)")),
        k_cache=lambda a: odd_page_stride(a["k_cache"]), v_cache=lambda a: odd_page_stride(a["v_cache"])),
    row("k_cache-device", "nhd", ValueError, "k_cache", expect(X("a tensor on cpu (where qkv is)"), "meta"),
        k_cache=lambda a: a["k_cache"].to(META)),
    row("k_cache-misaligned", "shuffle", ValueError, "k_cache",
        expect("a 16-byte aligned data pointer .*", "address 0x[0-9a-f]+"), k_cache=lambda a: misaligned(a["k_cache"])),
    row("kv_cache-given-to-two-tensor-contract", "shuffle", ValueError, "kv_cache",
        expect(X(f"None (contract {SHUFFLE.name} keeps K and V in two tensors, k_cache and v_cache)"),
               tensor_of(torch.bfloat16, (4, 4, 16, 16, 8))), kv_cache=lambda a: a["k_cache"]),
    row("kv_cache-missing", "m3", ValueError, "kv_cache",
        expect(X("a tensor (contract vllm_m3 stores K and V in one tensor)"), "None"), kv_cache=None),
    row("v_cache-given-to-one-tensor-contract", "m3", ValueError, "v_cache",
        expect(X("None (contract vllm_m3 stores K and V in one tensor, kv_cache)"), "a bfloat16 tensor .*"),
        v_cache=lambda a: a["kv_cache"]),
    row("kv_cache-dtype", "m3", TypeError, "kv_cache", expect(KV_DTYPES, "float32"),
        kv_cache=lambda a: a["kv_cache"].float()),
    row("kv_cache-half-width", "m3", ValueError, "kv_cache",
        shape_of("m3", "k", (None, 4, 128, 128)), kv_cache=lambda a: a["kv_cache"][..., :128]),
    row("kv_cache-0d", "m3", ValueError, "kv_cache", shape_of("m3", "k", ()),
        kv_cache=torch.tensor(0.0, dtype=torch.bfloat16)),
    # ---- norm weights (head_dim is their size)
    row("q_norm_weight-size", "shuffle", ValueError, "q_norm_weight",
        expect(X("shape (128,) (head_dim, the size of k_norm_weight, whose heads fill the qkv row)"), X("(64,)")),
        q_norm_weight=lambda a: a["q_norm_weight"][:64]),
    row("k_norm_weight-size", "shuffle", ValueError, "k_norm_weight",
        expect(X("shape (128,) (head_dim, the size of q_norm_weight)"), X("(64,)")),
        k_norm_weight=lambda a: a["k_norm_weight"][:64]),
    row("q_norm_weight-dtype", "shuffle", TypeError, "q_norm_weight",
        expect(X("dtype bfloat16 (the dtype of qkv)"), "float16"), q_norm_weight=lambda a: a["q_norm_weight"].half()),
    row("q_norm_weight-0d", "sglang", ValueError, "q_norm_weight",
        expect(X("a 1-D tensor [head_dim] of at least one element"), X("shape ()")),
        q_norm_weight=torch.tensor(0.1, dtype=torch.bfloat16)),
    row("k_norm_weight-empty", "m3", ValueError, "k_norm_weight",
        expect(X("a 1-D tensor [head_dim] of at least one element"), X("shape (0,)")),
        k_norm_weight=torch.empty(0, dtype=torch.bfloat16)),
    row("q_norm_weight-device", "nhd", ValueError, "q_norm_weight", expect(X("a tensor on cpu (where qkv is)"), "meta"),
        q_norm_weight=lambda a: a["q_norm_weight"].to(META)),
    row("k_norm_weight-stride", "skip", ValueError, "k_norm_weight", expect("a contiguous tensor", X("strides (2,)")),
        k_norm_weight=lambda a: torch.stack([a["k_norm_weight"]] * 2, 1)[:, 0]),
    row("head_dim-unsupported", "shuffle", ValueError, "q_norm_weight",
        "unsupported signature: head_dim: " + X("head_dim must be one of 16, 32, 64, 128, 256, got 96"),
        names=("q_norm_weight", "head_dim"), qkv=_with_head_dim(96),
        q_norm_weight=torch.zeros(96, dtype=torch.bfloat16), k_norm_weight=torch.zeros(96, dtype=torch.bfloat16),
        index_q_norm_weight=torch.zeros(96, dtype=torch.bfloat16),
        index_k_norm_weight=torch.zeros(96, dtype=torch.bfloat16)),
    row("index_q_norm_weight-size", "shuffle", ValueError, "index_q_norm_weight",
        expect(X("shape (128,) (head_dim, the size of q_norm_weight)"), X("(64,)")),
        index_q_norm_weight=lambda a: a["index_q_norm_weight"][:64]),
    row("index_k_norm_weight-dtype", "nhd", TypeError, "index_k_norm_weight",
        expect(X("dtype bfloat16 (the dtype of qkv)"), "float32"),
        index_k_norm_weight=lambda a: a["index_k_norm_weight"].float()),
    row("index_q_norm_weight-missing", "sglang", ValueError, "index_q_norm_weight",
        expect(X("a tensor (required with index_mode 'full')"), "None"), index_q_norm_weight=None),
    row("index_k_norm_weight-not-tensor", "m3", TypeError, "index_k_norm_weight",
        expect("a torch.Tensor", X("0.5 (float)")), index_k_norm_weight=0.5),
    # ---- the index cache, index_q_out
    row("index_cache-missing", "shuffle", ValueError, "index_cache",
        expect(X("a tensor (required with index_mode 'full')"), "None"), index_cache=None),
    row("index_cache-dtype", "shuffle", TypeError, "index_cache", expect(KV_DTYPES, "float32"),
        index_cache=lambda a: a["index_cache"].float(), index_q_out=None),
    row("index_cache-shape", "shuffle", ValueError, "index_cache",
        shape_of("shuffle", "index", (None, 24, 128)),  # a page size the contract does not allow
        index_cache=lambda a: a["index_cache"][:, :24]),
    row("index_cache-flavour", "nhd", TypeError, "index_cache",
        expect(X("dtype float8_e4m3fn (the FP8 flavour of k_cache)"), "float8_e4m3fnuz"),
        index_cache=lambda a: a["index_cache"].view(torch.float8_e4m3fnuz), index_q_out=None),
    row("index_cache-device", "m3", ValueError, "index_cache", expect(X("a tensor on cpu (where qkv is)"), "meta"),
        index_cache=lambda a: a["index_cache"].to(META)),
    row("index_q_out-dtype", "shuffle", TypeError, "index_q_out",
        expect(X("dtype bfloat16 (the dtype of index_cache)"), "float16"), index_q_out=lambda a: a["index_q_out"].half()),
    row("index_q_out-shape", "sglang", ValueError, "index_q_out",
        expect(X(f"shape ({T}, {NIQ}, 128) or ({T}, {NIQ * 128})"), X(f"({T}, 1, 128)")),
        index_q_out=lambda a: a["index_q_out"][:, :1]),
    # ---- arguments that mean nothing for the call
    row("index_cache-in-none-mode", "none", ValueError, "index_cache",
        expect(X("None (index_mode 'none' has no index branch)"), tensor_of(torch.bfloat16, (2, 64, 128))),
        index_cache=torch.zeros(2, 64, 128, dtype=torch.bfloat16)),
    row("index_q_norm_weight-in-none-mode", "none", ValueError, "index_q_norm_weight",
        expect(X("None (index_mode 'none' has no index branch)"), tensor_of(torch.bfloat16, (128,))),
        index_q_norm_weight=lambda a: a["q_norm_weight"]),
    row("index_slot_mapping-in-none-mode", "none", ValueError, "index_slot_mapping",
        expect(X("None (index_mode 'none' has no index branch)"), "a int64 tensor .*"),
        index_slot_mapping=lambda a: a["slot_mapping"]),
    row("index_q_out-in-none-mode", "none", ValueError, "index_q_out",
        expect(X("None (index_mode 'none' has no index branch)"), "a bfloat16 tensor .*"),
        index_q_out=torch.empty(T, NIQ, 128, dtype=torch.bfloat16)),
    row("index_cache-in-skip-mode", "skip", ValueError, "index_cache",
        expect(X("None (index_mode 'skip' reads and writes nothing index-related)"), "a bfloat16 tensor .*"),
        index_cache=torch.zeros(2, 64, 128, dtype=torch.bfloat16)),
    row("index_k_norm_weight-in-skip-mode", "skip", ValueError, "index_k_norm_weight",
        expect(X("None (index_mode 'skip' reads and writes nothing index-related)"), "a bfloat16 tensor .*"),
        index_k_norm_weight=lambda a: a["k_norm_weight"]),
    row("index_q_out-in-skip-mode", "skip", ValueError, "index_q_out",
        expect(X("None (index_mode 'skip' reads and writes nothing index-related)"), "a bfloat16 tensor .*"),
        index_q_out=torch.empty(T, NIQ, 128, dtype=torch.bfloat16)),
    row("k_scale-for-bf16-cache", "shuffle", ValueError, "k_scale",
        expect(X("None (" + NO_SCALE.format("k_cache") + ")"), tensor_of(torch.float32, (1,))), k_scale=torch.ones(1)),
    row("v_scale-for-bf16-cache", "m3", ValueError, "v_scale",
        expect(X("None (" + NO_SCALE.format("kv_cache") + ")"), tensor_of(torch.float32, (4,))), v_scale=torch.ones(4)),
    # ---- scales of FP8 caches
    row("k_scale-shape", "shuffle_fp8", ValueError, "k_scale", expect(SCALE_SHAPE, X("(3,)")), k_scale=torch.ones(3)),
    row("k_scale-empty", "nhd", ValueError, "k_scale", expect(SCALE_SHAPE, X("(0,)")), k_scale=torch.ones(0)),
    row("k_scale-dtype", "shuffle_fp8", TypeError, "k_scale", expect("dtype float32", "float64"),
        k_scale=torch.ones(1, dtype=torch.float64)),
    row("k_scale-device", "shuffle_fp8", ValueError, "k_scale", expect(X("a tensor on cpu (where qkv is)"), "meta"),
        k_scale=torch.ones(1, device=META)),
    row("k_scale-not-tensor", "nhd", TypeError, "k_scale", expect("a torch.Tensor", X("1.0 (float)")), k_scale=1.0),
    row("v_scale-stride", "nhd", ValueError, "v_scale", expect("a contiguous tensor", X("strides (2,)")),
        v_scale=torch.ones(8)[::2]),
    row("v_scale-granularity", "shuffle_fp8", ValueError, "v_scale",
        expect(X("the granularity of k_scale (per_tensor)"), "unit"), v_scale=None),
    row("kv_scale-per-head-unsupported", "shuffle_fp8", ValueError, "k_scale",
        "unsupported signature: " + allows(SHUFFLE, got="per_head"), k_scale=torch.ones(4), v_scale=torch.ones(4)),
    row("kv_scale-unit-unsupported", "shuffle_fp8", ValueError, "k_scale",
        "unsupported signature: " + allows(SHUFFLE, got="unit"), k_scale=None, v_scale=None),
    row("kv_scale-per-tensor-unsupported", "sglang", ValueError, "k_scale",
        "unsupported signature: " + allows(SGLANG, got="per_tensor"), k_scale=torch.ones(1), v_scale=torch.ones(1)),
    # ---- outputs passed in
    row("q_out-shape", "shuffle", ValueError, "q_out",
        expect(X(f"shape ({T}, {NQ}, 128) or ({T}, {NQ * 128})"), X(f"({T}, {NQ}, 127)")),
        q_out=torch.empty(T, NQ, 127, dtype=torch.bfloat16)),
    row("q_out-dtype", "shuffle", TypeError, "q_out", expect("dtype bfloat16", "float16"),
        q_out=lambda a: a["q_out"].half()),
    row("q_out-stride", "nhd", ValueError, "q_out", expect(ROWS_OF, r"strides \(.*\)"),
        q_out=lambda a: torch.empty(NQ, T, 128, dtype=torch.bfloat16).transpose(0, 1)),
    row("q_out-row-stride", "m3", ValueError, "q_out", expect(ROWS_OF, X(f"strides ({NQ * 128 + 4}, 1)")),
        q_out=lambda a: torch.empty(T, NQ * 128 + 4, dtype=torch.bfloat16)[:, :NQ * 128]),
    # ---- per-token scales: the scale caches
    row("k_scale_cache-dtype", "pertoken", TypeError, "k_scale_cache", expect("dtype float32", "float16"),
        k_scale_cache=lambda a: a["k_scale_cache"].half()),
    row("v_scale_cache-missing", "pertoken", ValueError, "v_scale_cache",
        expect(X("a tensor (per-token scales are written to both scale caches)"), "None"), v_scale_cache=None),
    row("k_scale_cache-shape", "pertoken", ValueError, "k_scale_cache",
        shape_of("pertoken", "k_scale", (None, 4, 8)), k_scale_cache=lambda a: a["k_scale_cache"][:, :, :8]),
    row("k_scale-with-per-token", "pertoken", ValueError, "k_scale",
        expect(X("None (per-token scales (k_scale_cache, v_scale_cache) are computed by the kernel, not given)"),
               X("a float32 tensor of shape (1,)")), k_scale=torch.ones(1)),
    row("k_scale_cache-for-bf16-cache", "shuffle", ValueError, "k_scale_cache",
        expect(X(f"None ({NO_SCALE.format('k_cache')})"), X("a float32 tensor of shape (3, 4, 16)")),
        k_scale_cache=torch.ones(3, 4, 16), v_scale_cache=torch.ones(3, 4, 16)),
    row("k_scale_cache-unsupported", "nhd", ValueError, "k_scale_cache",
        "unsupported signature: kv_scale: contract vllm_nhd allows kv_scale none, per_tensor, per_head, "
        "not per_token_head", names=("k_scale_cache",), k_scale=None, v_scale=None, k_scale_cache=torch.ones(4, 64),
        v_scale_cache=torch.ones(4, 64)),
    row("v_scale_cache-heads-overlap", "aiter", ValueError, "v_scale_cache",
        expect(r"the stride of dimension 0 to span the dimensions after it \(\d+ elements\)", r"strides \(8, 1\)"),
        v_scale_cache=lambda a: a["v_scale_cache"].as_strided(a["v_scale_cache"].shape, (8, 1))),
    # ---- the FP8 query output
    row("q_fp8_out-dtype", "qfp8", TypeError, "q_fp8_out", expect("dtype float8_e4m3fn, float8_e4m3fnuz", "bfloat16"),
        q_fp8_out=lambda a: a["q_out"]),
    row("q_fp8_out-flavour", "shuffle_fp8", TypeError, "q_fp8_out",
        expect(X("dtype float8_e4m3fnuz (the FP8 flavour of k_cache)"), "float8_e4m3fn"),
        q_fp8_out=torch.empty(T, NQ, 128, dtype=torch.float8_e4m3fn), q_fp8_scale=torch.ones(1)),
    row("q_fp8_out-shape", "qfp8", ValueError, "q_fp8_out",
        expect(X(f"shape ({T}, {NQ}, 128) or ({T}, {NQ * 128})"), X(f"({T}, {NQ - 1}, 128)")),
        q_fp8_out=torch.empty(T, NQ - 1, 128, dtype=torch.float8_e4m3fn)),
    row("q_fp8_scale-missing", "qfp8", ValueError, "q_fp8_scale", expect(X("a tensor (the scale of q_fp8_out)"), "None"),
        q_fp8_scale=None),
    row("q_fp8_scale-shape", "qfp8", ValueError, "q_fp8_scale", expect(X("shape (1,) or () (a device scalar)"), X("(2,)")),
        q_fp8_scale=torch.ones(2)),
    row("q_fp8_scale-without-output", "shuffle", ValueError, "q_fp8_scale",
        expect(X("None (q_fp8_out is None: there is no FP8 query output)"), X("a float32 tensor of shape (1,)")),
        q_fp8_scale=torch.ones(1)),
    # ---- K and index_k beside their caches
    row("k_out-dtype", "m3", TypeError, "k_out", expect("dtype bfloat16", "float32"),
        k_out=torch.empty(T, 4, 128)),
    row("k_out-shape", "nhd", ValueError, "k_out", expect(X(f"shape ({T}, 4, 128) or ({T}, 512)"), X(f"({T}, 3, 128)")),
        k_out=torch.empty(T, 3, 128, dtype=torch.bfloat16)),
    row("k_out-stride", "shuffle", ValueError, "k_out", expect(ROWS_OF, X(f"strides ({4 * 128 + 2}, 1)")),
        k_out=lambda a: torch.empty(T, 4 * 128 + 2, dtype=torch.bfloat16)[:, :4 * 128]),
    row("index_k_out-in-skip-mode", "skip", ValueError, "index_k_out",
        expect(X("None (index_mode 'skip' reads and writes nothing index-related)"), X("a bfloat16 tensor of shape (6, 128)")),
        index_k_out=torch.empty(T, 128, dtype=torch.bfloat16)),
    row("index_k_out-shape", "shuffle", ValueError, "index_k_out", expect(X(f"shape ({T}, 1, 128) or ({T}, 128)"),
                                                                          X(f"({T}, 2, 128)")),
        index_k_out=torch.empty(T, 2, 128, dtype=torch.bfloat16)),
    row("q_out-device", "sglang", ValueError, "q_out", expect(X("a tensor on cpu (where qkv is)"), "meta"),
        q_out=lambda a: a["q_out"].to(META)),
    row("q_out-0d", "m3", ValueError, "q_out",
        expect(X(f"shape ({T}, {NQ}, 128) or ({T}, {NQ * 128})"), X("()")), q_out=torch.tensor(0.0, dtype=torch.bfloat16)),
    row("q_out-misaligned", "shuffle", ValueError, "q_out", expect("a 16-byte aligned data pointer .*", "address 0x[0-9a-f]+"),
        q_out=lambda a: misaligned(a["q_out"])),
    row("q_out-not-tensor", "skip", TypeError, "q_out", expect("a torch.Tensor", X("'x' (str)")), q_out="x"),
]


def _value(v, args):
    return v(args) if callable(v) else v


def _bytes(t: torch.Tensor):
    """A copy of the whole storage under t (views included), or None where it has no data."""
    if t.device.type == "meta" or t.layout is not torch.strided:
        return None
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def _call_and_check(call, args: dict, r: Row):
    """Run call(**args) (or call(*args) for a list): it must raise r's error and write nothing."""
    tensors = [t for t in (args.values() if isinstance(args, dict) else args) if isinstance(t, torch.Tensor)]
    before = [(t, _bytes(t)) for t in tensors]
    with pytest.raises((ValueError, TypeError)) as info:
        call(**args) if isinstance(args, dict) else call(*args)
    e = info.value
    msg = str(e)
    assert type(e) is r.exc, f"{type(e).__name__} instead of {r.exc.__name__}: {msg}"
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), \
        f"a chained error shows: {e.__context__!r}"
    form = FORM.fullmatch(msg)
    assert form, f"not of the form 'ARG: expected WHAT, got GIVEN': {msg}"
    assert form["arg"] == r.blame, msg
    assert re.fullmatch(f"{re.escape(r.blame)}: {r.pattern}", msg, re.S), f"{msg!r} !~ {r.pattern!r}"
    for name in r.names:
        assert re.search(rf"\b{re.escape(name)}\b", msg), f"{name} not named in: {msg}"
    for t, saved in before:
        if saved is not None:
            assert torch.equal(_bytes(t), saved), f"a tensor of shape {tuple(t.shape)} was written"


PARAMS = [pytest.param(r, True, id=r.id) for r in ROWS] + [
    pytest.param(r, False, id=f"{r.id}-allocated") for r in ROWS if not set(r.changes) & set(OUTPUTS)]


@pytest.mark.parametrize("r,outputs_passed", PARAMS)
def test_bad_input(r: Row, outputs_passed: bool):
    base = BASES[r.base]
    args = dict(base) if outputs_passed else {k: v for k, v in base.items() if k not in OUTPUTS}
    args.update({k: _value(v, base) for k, v in r.changes.items()})
    _call_and_check(fused_qknorm_rope_cache, args, r)


def test_the_table_covers_every_argument_and_contract():
    import inspect

    params = set(inspect.signature(fused_qknorm_rope_cache).parameters) - {"checked", "_reference"}
    assert params <= {k for r in ROWS for k in r.changes}
    assert len(ROWS) >= 60 and len({r.id for r in ROWS}) == len(ROWS)
    assert len({VARIANTS[r.base].contract.name for r in ROWS}) >= 4  # SHUFFLE, NHD (two), one tensor
    assert {VARIANTS[r.base].index_mode for r in ROWS} == set(IndexMode)


# ---- what is legal --------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_call_of_no_token_is_legal_and_writes_nothing(name):
    args = dict(BASES[name])
    for key in ("qkv", "positions", "slot_mapping", "index_slot_mapping"):
        if args.get(key) is not None:
            args[key] = args[key][:0]
    args.pop("q_out")
    args.pop("index_q_out", None)
    if args.get("q_fp8_out") is not None:
        args["q_fp8_out"] = args["q_fp8_out"][:0]
    before = {k: _bytes(t) for k, t in args.items() if isinstance(t, torch.Tensor)}
    q, iq = fused_qknorm_rope_cache(**args)
    if args.get("q_fp8_out") is not None:
        assert q is None  # q_fp8_out instead of q_out
    else:
        assert q.shape == (0, NQ, 128)
    assert (iq is None) == (VARIANTS[name].index_mode is not IndexMode.FULL)
    for k, saved in before.items():
        assert torch.equal(_bytes(args[k]), saved), k


def test_an_empty_slot_mapping_writes_no_cache_and_a_0d_scale_is_per_tensor():
    args = dict(BASES["shuffle_fp8"])
    args.update(slot_mapping=args["slot_mapping"][:0], index_slot_mapping=args["index_slot_mapping"][:0],
                k_scale=args["k_scale"].reshape(()), v_scale=args["v_scale"].reshape(()))
    caches = {k: _bytes(args[k]) for k in ("k_cache", "v_cache", "index_cache")}
    q, iq = fused_qknorm_rope_cache(**args)
    assert q is args["q_out"] and iq is args["index_q_out"]
    for k, saved in caches.items():
        assert torch.equal(_bytes(args[k]), saved), k


# ---- the AITER drop-in: the same rules under AITER's argument list ---------------------------
AITER_ORDER = ("qkv", "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "num_heads",
               "num_kv_heads", "num_index_heads", "rotary_dim", "eps", "slot_mapping", "k_cache", "v_cache",
               "q_out", "index_q_norm_weight", "index_k_norm_weight", "index_slot_mapping", "index_cache",
               "index_q_out", "kv_cache_dtype", "k_scale", "v_scale", "skip_index_branch")


def aiter_args(name: str, **changes) -> dict:
    a = dict(BASES[name], q_out=BASES[name]["q_out"].view(T, -1),
             kv_cache_dtype="fp8" if VARIANTS[name].kv_fp8 else "auto", skip_index_branch=False)
    a.update(changes)
    return {k: a.get(k) for k in AITER_ORDER}


AITER_ROWS = [
    row("aiter-num_heads-negative", "shuffle", ValueError, "num_heads", expect(POS_INT, "-1"), num_heads=-1),
    row("aiter-qkv-0d", "shuffle", ValueError, "qkv", expect(X("a 2-D tensor [num_tokens, row]"), X("shape ()")),
        qkv=torch.tensor(1.0, dtype=torch.bfloat16)),
    row("aiter-q_norm_weight-size", "shuffle", ValueError, "q_norm_weight", expect(r"shape \(128,\) .*", X("(64,)")),
        q_norm_weight=lambda a: a["q_norm_weight"][:64]),
    row("aiter-kv_cache_dtype-unknown", "shuffle", ValueError, "kv_cache_dtype", expect("'auto' or an 'fp8…' name", "'int8'"),
        kv_cache_dtype="int8"),
    row("aiter-kv_cache_dtype-type", "shuffle", TypeError, "kv_cache_dtype",
        expect(X("'auto' or an 'fp8…' name (a str)"), X("None (NoneType)")), kv_cache_dtype=None),
    row("aiter-fp8-with-bf16-cache", "shuffle", TypeError, "k_cache",
        expect(X("dtype float8_e4m3fn, float8_e4m3fnuz or uint8 (kv_cache_dtype='fp8')"), "bfloat16"),
        names=("k_cache", "kv_cache_dtype"), kv_cache_dtype="fp8"),
    row("aiter-positions-short", "shuffle", ValueError, "positions", expect(X(f"{T} entries (one per qkv row)"), f"{T - 1}"),
        positions=lambda a: a["positions"][:T - 1]),
    row("aiter-index_cache-missing", "shuffle", ValueError, "index_cache",
        expect(X("a tensor (required with index_mode 'full')"), "None"), index_cache=None),
    row("aiter-k_scale-shape", "shuffle_fp8", ValueError, "k_scale", expect(SCALE_SHAPE, X("(3,)")), k_scale=torch.ones(3)),
]


@pytest.mark.parametrize("r", AITER_ROWS, ids=lambda r: r.id)
def test_bad_input_through_the_aiter_drop_in(r: Row):
    base = BASES[r.base]
    args = aiter_args(r.base, **{k: _value(v, base) for k, v in r.changes.items()})
    _call_and_check(minimax_m3_qknorm_rope_cache_shuffle_insert, args, r)


def _clone(args: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def test_the_aiter_drop_in_maps_what_aiter_accepts():
    """AITER reads the first num_tokens entries of longer index vectors, ignores scales with
    kv_cache_dtype 'auto' and every index tensor with skip_index_branch (the native call
    refuses those as meaningless): the drop-in passes none of it on."""
    native = _clone(BASES["shuffle"])
    mine = aiter_args("shuffle", **_clone(BASES["shuffle"]))
    for key in ("positions", "slot_mapping", "index_slot_mapping"):
        mine[key] = torch.cat([mine[key], torch.full((3,), 10 ** 9, dtype=torch.int64)])
    mine.update(k_scale=torch.ones(1), v_scale=torch.ones(1))  # meaningless with "auto": ignored
    fused_qknorm_rope_cache(**native)
    minimax_m3_qknorm_rope_cache_shuffle_insert(**mine)
    for key in ("q_out", "index_q_out", "k_cache", "v_cache", "index_cache"):
        assert torch.equal(native[key].view(torch.uint8).flatten(), mine[key].view(torch.uint8).flatten()), key

    skip = _clone(BASES["skip"])
    mine = aiter_args("skip", **_clone(BASES["skip"]))
    full = BASES["shuffle"]
    index = {k: full[k].clone() for k in ("index_q_norm_weight", "index_k_norm_weight", "index_slot_mapping",
                                           "index_cache", "index_q_out")}
    mine.update(index, skip_index_branch=True)
    fused_qknorm_rope_cache(**skip)
    minimax_m3_qknorm_rope_cache_shuffle_insert(**mine)
    for key in ("q_out", "k_cache", "v_cache"):
        assert torch.equal(skip[key].view(torch.uint8).flatten(), mine[key].view(torch.uint8).flatten()), key
    for key, t in index.items():
        assert torch.equal(t.view(torch.uint8), full[key].view(torch.uint8)), f"{key} was written in skip mode"


def test_the_aiter_drop_in_reads_a_missing_or_empty_fp8_scale_as_the_identity():
    """AITER: no scale (or an empty one) with an FP8 kv_cache_dtype is scale 1; the SHUFFLE
    contract holds per-tensor scales, so the drop-in passes 1.0 and writes what a unit scale does."""
    ref = _clone(BASES["shuffle_fp8"])
    ref.update(k_scale=torch.ones(1), v_scale=torch.ones(1))
    fused_qknorm_rope_cache(**ref)
    for scale in (None, torch.ones(0)):
        mine = aiter_args("shuffle_fp8", **_clone(BASES["shuffle_fp8"]))
        mine.update(k_scale=scale, v_scale=scale)
        minimax_m3_qknorm_rope_cache_shuffle_insert(**mine)
        for key in ("q_out", "index_q_out", "k_cache", "v_cache", "index_cache"):
            assert torch.equal(ref[key].view(torch.uint8).flatten(), mine[key].view(torch.uint8).flatten()), key


def test_an_output_row_stride_past_the_kernels_32_bit_row_offsets_is_refused():
    """The kernel's output row offsets are products of 32-bit factors, so a row stride of
    2^31 elements or more is refused (a meta tensor has one without memory)."""
    from kvforge.runtime.validate import _rows
    _rows("q_out", torch.empty_strided((2, 128), ((1 << 31) - 8, 1), dtype=torch.bfloat16, device="meta"), 128)
    with pytest.raises(ValueError, match=X(f"q_out: expected a row stride under 2^31 elements, got {1 << 31}")):
        _rows("q_out", torch.empty_strided((2, 128), (1 << 31, 1), dtype=torch.bfloat16, device="meta"), 128)
