"""vLLM's unit tests of `fused_minimax_m3_qknorm_rope_kv_insert`
(tests/kernels/test_fused_minimax_m3_qknorm_rope_kv_insert.py: their shapes, inputs, seeds
and tolerances) re-expressed through kvforge's drop-in, runtime/vllm_compat.py.

Each case builds vLLM's inputs (bf16, head_dim 128, rotary_dim 64, eps 1e-6, a base-5e6
cos/sin table, weights randn * 0.1, random positions; caches of num_blocks = ceil(N /
block_size) + 1 blocks, slots randperm(num_blocks * block_size)[:N], index slots those
rolled by one), calls the drop-in as vLLM's callers do (positionally where they do) and
checks vLLM's semantics: what is written into qkv in place and what is left as it was, the
caches at the slots (read by vLLM's logical addressing, and through the contract's own
index expressions: tests/layout_oracle.py), against vLLM's unfused oracle at vLLM's
tolerances. Two tiers:

- CPU (every case but N=513): the drop-in runs kvforge's torch reference, and its results
  must also equal, bit for bit, a direct `fused_qknorm_rope_cache` call's.
- GPU (`gpu`, N=513 too): the same calls on CUDA tensors, outputs and caches poisoned
  first, against the reference at SPEC §6's bar (runtime/testing.compare: every addressed
  element within one ulp, at least 99% bit-identical, every other byte unchanged), and the
  same semantic checks. The variants the matrix needs (page sizes 16 and 64, FP8 index,
  NHD strides: mostly unlisted) are built at once by a module fixture.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import zlib

import pytest
import torch

from kvforge.codegen.signature import CALL_NAMES
from kvforge.runtime import api, build, engine_args, toolchain, vllm_compat
from kvforge.runtime.api import fused_qknorm_rope_cache
from kvforge.runtime.registry import source_of
from kvforge.runtime.testing import compare
from kvforge.runtime.validate import check
from kvforge.runtime.vllm_compat import fused_minimax_m3_qknorm_rope_kv_insert
from layout_oracle import read

pytestmark = pytest.mark.filterwarnings("ignore::kvforge.runtime.registry.UnlistedVariantWarning")

HEAD_DIM, ROTARY_DIM, EPS, BASE, MAX_POS = 128, 64, 1e-6, 5e6, 4096
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
Q_FP8_SCALE = 0.5
SEEDS = {"dense": 0, "full": 1, "profile": 1, "skip": 2}  # vLLM's: dense 0, sparse 1, skip 2


# ---- vLLM's unfused oracle (its test's helpers) ---------------------------------------
def make_cos_sin_cache() -> torch.Tensor:
    inv_freq = 1.0 / (BASE ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.float32) / ROTARY_DIM))
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DTYPE)


COS_SIN = make_cos_sin_cache()


def gemma_rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + EPS) * (1.0 + w.float())).to(x.dtype)


def apply_rope_neox_partial(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = ROTARY_DIM // 2
    cs = COS_SIN[positions].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    out = x.float().clone()
    x1, x2 = out[..., :half].clone(), out[..., half:ROTARY_DIM].clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:ROTARY_DIM] = x2 * cos + x1 * sin
    return out.to(x.dtype)


def norm_rope_ref(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return apply_rope_neox_partial(gemma_rmsnorm(x, w), positions)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    bad = (_bytes(got) != _bytes(want)).flatten().nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} bytes differ, first at byte {int(bad[0])}"


def _assert_fp8_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """vLLM's assert_fp8_cache_close: codes at most one apart, or both zero (+0 and -0)."""
    g, w = _bytes(got).int(), _bytes(want).int()
    ok = ((g - w).abs() <= 1) | (((g & 0x7F) == 0) & ((w & 0x7F) == 0))
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} FP8 codes more than one apart"


def _close(got, want, rtol: float, what: str, atol: float = 0.0) -> None:
    """torch.testing.assert_close's |got - want| <= atol + rtol * |want| (atol: rtol unless
    given), and no NaN."""
    g, w = got.float(), want.float()
    bound = (atol or rtol) + rtol * w.abs()
    bad = ~((g - w).abs() <= bound)
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {bad.numel()} elements outside rtol={rtol}, "
                                 f"atol={atol or rtol} (worst excess {float(((g - w).abs() - bound).nan_to_num(1e9).max()):.3g})")


@pytest.fixture(autouse=True, scope="module")
def _quick_cpu():
    """This module's tensors are small: one torch thread (on a busy machine, a second one's
    waits cost seconds a test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---- the cases -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One call of the drop-in, as vLLM's tests (and callers) make it."""

    kind: str                   # dense | full (sparse, index branch) | skip | profile (full, no caches)
    n: int                      # tokens
    nq: int = 16
    nkv: int = 4
    niq: int = 4                # (0 for dense rows)
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    q_out: bool = False         # q into a q_out buffer (else in place, or FP8 only)
    q_fp8: bool = False         # q_fp8_out at q_fp8_scale 0.5
    index_fp8: bool = False     # float8_e4m3fn index cache and index_q_out
    nhd: bool = False           # kv_cache with NHD strides (a [blocks, block_size, nkv, 2D] tensor transposed)
    index_slots: bool = True    # index_slot_mapping passed (else it defaults to slot_mapping)

    @property
    def heads(self) -> int:
        index = 0 if self.kind == "dense" else self.niq + 1
        return self.nq + 2 * self.nkv + index


def _inputs(case: Case) -> dict:
    """The drop-in's arguments for a case, on the CPU. Drawn in one order whatever the case's
    options, so the cases of a pair (q_out or not, bf16 or FP8 index) get the same values."""
    gen = torch.Generator().manual_seed(SEEDS[case.kind])
    N, D, nq = case.n, HEAD_DIM, case.nq
    qkv = torch.randn(N, case.heads * D, generator=gen).to(DTYPE)
    positions = torch.randint(0, MAX_POS, (N,), generator=gen)
    q_w, k_w, iq_w, ik_w = ((torch.randn(D, generator=gen) * 0.1).to(DTYPE) for _ in range(4))
    args = dict(qkv=qkv, q_norm_weight=q_w, k_norm_weight=k_w, cos_sin_cache=COS_SIN, positions=positions,
                num_heads=nq, num_kv_heads=case.nkv, rotary_dim=ROTARY_DIM, eps=EPS)
    if case.q_out:
        args["q_out"] = torch.zeros(N, nq * D, dtype=DTYPE)
    if case.q_fp8:
        args.update(q_fp8_out=torch.zeros(N, nq * D, dtype=FP8), q_fp8_scale=Q_FP8_SCALE)
    if case.kind == "dense":
        return dict(args, kv_cache_dtype="auto")
    bs = case.block_size
    num_blocks = math.ceil(N / bs) + 1
    slot_mapping = torch.randperm(num_blocks * bs, generator=gen)[:N]
    random_index_cache = torch.randn(num_blocks, bs, D, generator=gen).to(DTYPE)
    args["num_index_heads"] = case.niq
    if case.kind in ("full", "profile"):
        args.update(index_q_norm_weight=iq_w, index_k_norm_weight=ik_w)
    if case.kind == "profile":
        return args
    kv_dtype = torch.uint8 if case.kv_cache_dtype.startswith("fp8") else DTYPE
    if case.nhd:
        kv_cache = torch.zeros(num_blocks, bs, case.nkv, 2 * D, dtype=kv_dtype).transpose(1, 2)
    else:
        kv_cache = torch.zeros(num_blocks, case.nkv, bs, 2 * D, dtype=kv_dtype)
    args.update(slot_mapping=slot_mapping, kv_cache=kv_cache, block_size=bs, kv_cache_dtype=case.kv_cache_dtype)
    if case.kind == "skip":  # vLLM's skip test: a random index cache that must stay as it is
        return dict(args, index_cache=random_index_cache, skip_index_branch=True)
    idx_dtype = FP8 if case.index_fp8 else DTYPE
    args.update(index_cache=torch.zeros(num_blocks, bs, D, dtype=idx_dtype),
                index_q_out=torch.zeros(N, case.niq * D, dtype=idx_dtype))
    if case.index_slots:
        args["index_slot_mapping"] = torch.roll(slot_mapping, 1)
    return args


_PARAMS = inspect.signature(fused_minimax_m3_qknorm_rope_kv_insert).parameters
# How many leading arguments vLLM's callers pass positionally: the dense layer 9, the sparse
# layer all 20 of the R2 list (the newer ones by keyword), the skip test none past eps.
_POSITIONAL = {"dense": 9, "profile": 12, "full": 20, "skip": 9}


def _call(case: Case, args: dict) -> None:
    names = list(_PARAMS)[:_POSITIONAL[case.kind]]
    positional = [args.get(name, _PARAMS[name].default) for name in names]
    fused_minimax_m3_qknorm_rope_kv_insert(*positional, **{n: v for n, v in args.items() if n not in names})


MUTATED = ("qkv", "kv_cache", "index_cache", "q_out", "index_q_out", "q_fp8_out")


def _copy(args: dict, device="cpu") -> dict:
    """args with every tensor copied to `device`, strides kept (an NHD cache stays a view)."""
    def one(t):
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)
    return {k: one(v) for k, v in args.items()}


# ---- vLLM's semantics ------------------------------------------------------------------
def _check_vllm(case: Case, raw: dict, out: dict) -> None:
    """What vLLM's op writes, given the arguments before (raw) and after (out) the call."""
    N, D, nq, nkv = case.n, HEAD_DIM, case.nq, case.nkv
    x, y = raw["qkv"].view(N, -1, D), out["qkv"].view(N, -1, D)
    pos = raw["positions"]
    _assert_same(y[:, nq + nkv:nq + 2 * nkv], x[:, nq + nkv:nq + 2 * nkv], "qkv's V")  # never modified
    k_ref = norm_rope_ref(x[:, nq:nq + nkv], raw["k_norm_weight"], pos)
    _close(y[:, nq:nq + nkv], k_ref, 2e-2, "K in place")
    q_ref = norm_rope_ref(x[:, :nq], raw["q_norm_weight"], pos)
    if case.q_out or case.q_fp8:  # q goes to q_out or (FP8 only) nowhere in bf16: qkv keeps its q
        _assert_same(y[:, :nq], x[:, :nq], "qkv's q")
    q = out["q_out"].view(N, nq, D) if case.q_out else y[:, :nq] if not case.q_fp8 else None  # bf16 q
    if q is not None:
        _close(q, q_ref, 2e-2, "q")
    if case.q_fp8:
        q_fp8 = out["q_fp8_out"].view(N, nq, D)
        if q is not None:  # vLLM: byte-identical to scaled_fp8_quant(q_out, scale 0.5)
            want = (q.float() * (1.0 / Q_FP8_SCALE)).clamp(-448, 448).to(FP8)
            _assert_same(q_fp8, want, "q_fp8_out")
        # (and close to the oracle's q at vLLM's FP8 tolerance)
        _close(q_fp8.float() * Q_FP8_SCALE, q_ref, 0.13, "q_fp8_out * q_fp8_scale", atol=0.05)
    if case.kind == "dense":
        return
    base, niq = nq + 2 * nkv, case.niq
    if case.kind == "skip":  # the index slices untouched
        _assert_same(y[:, base:], x[:, base:], "qkv's index_q and index_k")
    else:
        ik_ref = norm_rope_ref(x[:, base + niq:], raw["index_k_norm_weight"], pos)
        _close(y[:, base + niq:], ik_ref, 1e-2, "index_k in place")
        iq_ref = norm_rope_ref(x[:, base:base + niq], raw["index_q_norm_weight"], pos)
        if raw.get("index_q_out") is None:
            _close(y[:, base:base + niq], iq_ref, 1e-2, "index_q in place")
        else:
            _assert_same(y[:, base:base + niq], x[:, base:base + niq], "qkv's index_q")
            iq = out["index_q_out"].view(N, niq, D)
            if case.index_fp8:  # vLLM: FP8 against bf16 at rtol 0.13, atol 0.05
                _close(iq, iq_ref, 0.13, "FP8 index_q_out", atol=0.05)
            else:
                _close(iq, iq_ref, 1e-2, "index_q_out")
    if case.kind == "profile":
        return
    _check_kv_cache(case, raw, out, y, k_ref)
    _check_index_cache(case, raw, out, y)


def _some(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


def _check_kv_cache(case: Case, raw: dict, out: dict, y: torch.Tensor, k_ref: torch.Tensor) -> None:
    """kv_cache[block, head, offset, :D] = K, [..., D:] = V at each token's slot (vLLM's logical
    [num_blocks, nkv, block_size, 2D] addressing, whatever the strides); nothing else written."""
    D, nq, nkv, bs = HEAD_DIM, case.nq, case.nkv, case.block_size
    before, after = raw["kv_cache"], out["kv_cache"]
    slots = raw["slot_mapping"]
    block, off = slots // bs, slots % bs
    written = torch.zeros(after.shape[:3], dtype=torch.bool)
    written[block, :, off] = True
    _assert_same(after[~written], before[~written], "kv_cache outside the slots")
    k_got, v_got = after[block, :, off, :D], after[block, :, off, D:]  # [N, nkv, D]
    k, v = y[:, nq:nq + nkv], y[:, nq + nkv:nq + 2 * nkv]
    if case.kv_cache_dtype == "auto":
        _assert_same(k_got, k, "K cache (the K written into qkv)")
        _close(k_got, k_ref, 1e-2, "K cache")
        _assert_same(v_got, v, "V cache")
    else:  # vLLM: reshape_and_cache_flash(k_out, v, ..., 'fp8', scale 1) of the bf16 K, within a code
        _assert_fp8_close(k_got, k.to(FP8), "FP8 K cache")
        _assert_same(v_got, v.to(FP8), "FP8 V cache")
    contract, physical = ("vllm_m3_nhd", after.transpose(1, 2)) if case.nhd else ("vllm_m3", after)
    for t in _some(case.n):  # the contract's expressions address vLLM's elements
        s = int(slots[t])
        assert torch.equal(read(contract, "k", physical, s, nkv, D, bs), after[s // bs, :, s % bs, :D])
        assert torch.equal(read(contract, "v", physical, s, nkv, D, bs), after[s // bs, :, s % bs, D:])


def _check_index_cache(case: Case, raw: dict, out: dict, y: torch.Tensor) -> None:
    """The index cache, addressed flat by slot as vLLM does: index_k (the value written into
    qkv) at each token's index slot; nothing else written (nothing at all in skip mode)."""
    D, base = HEAD_DIM, case.nq + 2 * case.nkv
    before, after = raw["index_cache"], out["index_cache"]
    if case.kind == "skip":
        _assert_same(after, before, "index_cache (skip_index_branch)")
        return
    slots = raw.get("index_slot_mapping")
    slots = raw["slot_mapping"] if slots is None else slots
    flat_before, flat = before.view(-1, D), after.view(-1, D)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[slots] = True
    _assert_same(flat[~written], flat_before[~written], "index_cache outside the slots")
    ik = y[:, base + case.niq]
    if case.index_fp8:  # quantized from fp32: within a code of the bf16 index_k's
        _assert_fp8_close(flat[slots], ik.to(FP8), "FP8 index cache")
    else:
        _assert_same(flat[slots], ik, "index cache")
    for t in _some(case.n):
        s = int(slots[t])
        assert torch.equal(read("vllm_m3", "index", after, s, case.nkv, D, case.block_size)[0], flat[s])


# ---- the same call made directly -------------------------------------------------------
def _check_direct(case: Case, raw: dict, out: dict) -> None:
    """The drop-in's results equal, bit for bit, those of one `fused_qknorm_rope_cache` call
    with the contract's arguments and separate outputs, written back where vLLM writes."""
    a = _copy(raw)
    N, D, nq, nkv, niq = case.n, HEAD_DIM, case.nq, case.nkv, case.niq
    mode = {"dense": "none", "skip": "skip"}.get(case.kind, "full")
    kw = dict(q_norm_weight=a["q_norm_weight"], k_norm_weight=a["k_norm_weight"], num_heads=nq, num_kv_heads=nkv,
              rotary_dim=ROTARY_DIM, eps=EPS, index_mode=mode, num_index_heads=0 if mode == "none" else niq,
              k_out=torch.empty(N, nkv, D, dtype=DTYPE))
    if "kv_cache" in a:
        kv = a["kv_cache"]
        if case.kv_cache_dtype != "auto":
            kv = kv.view(FP8)
            kw.update(k_scale=torch.ones(1), v_scale=torch.ones(1))
        kw.update(kv_cache=kv.transpose(1, 2) if case.nhd else kv, contract="vllm_m3_nhd" if case.nhd else "vllm_m3")
        slots = a["slot_mapping"]
    else:  # nothing inserted: a page no slot addresses
        kw.update(kv_cache=torch.zeros(1, nkv, 16, 2 * D, dtype=DTYPE), contract="vllm_m3")
        slots = torch.empty(0, dtype=torch.int64)
    q_in_place = not case.q_out and not case.q_fp8
    if case.q_out or q_in_place:
        kw["q_out"] = a["q_out"] if case.q_out else torch.empty(N, nq, D, dtype=DTYPE)
    if case.q_fp8:
        kw.update(q_fp8_out=a["q_fp8_out"], q_fp8_scale=torch.tensor([Q_FP8_SCALE]))
    if mode == "full":
        kw.update(index_q_norm_weight=a["index_q_norm_weight"], index_k_norm_weight=a["index_k_norm_weight"],
                  index_k_out=torch.empty(N, 1, D, dtype=DTYPE))
        if "kv_cache" in a:
            kw.update(index_cache=a["index_cache"], index_slot_mapping=a.get("index_slot_mapping"))
        else:
            kw["index_cache"] = torch.zeros(1, 16, D, dtype=DTYPE)
        kw["index_q_out"] = a.get("index_q_out")
        if kw["index_q_out"] is None:
            kw["index_q_out"] = torch.empty(N, niq, D, dtype=DTYPE)
    fused_qknorm_rope_cache(a["qkv"], a["positions"], a["cos_sin_cache"], slots, **kw)
    want = raw["qkv"].clone().view(N, -1, D)
    want[:, nq:nq + nkv] = kw["k_out"]
    if q_in_place:
        want[:, :nq] = kw["q_out"]
    if mode == "full":
        base = nq + 2 * nkv
        want[:, base + niq] = kw["index_k_out"][:, 0]
        if raw.get("index_q_out") is None:
            want[:, base:base + niq] = kw["index_q_out"]
    _assert_same(out["qkv"], want.view(N, -1), "qkv against the direct call")
    for name in MUTATED[1:]:
        if raw.get(name) is not None:
            _assert_same(out[name], a[name], f"{name} against the direct call")


# ---- running a case on either tier -----------------------------------------------------
def _poison(args: dict) -> None:
    """Random bytes in every cache and output passed (not qkv, the input written in place):
    one generator per name, so the cases of a pair get the same bytes."""
    for name in MUTATED[1:]:
        t = args.get(name)
        if t is not None:
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))


def _fp8_as_float8(t: torch.Tensor) -> torch.Tensor:
    return t.view(FP8) if t.dtype == torch.uint8 else t


def _run(case: Case, device: str, request) -> dict:
    """The case on the CPU (the reference, and the direct call) or on the GPU (against the
    reference on the same and on the complementary poison); returns the arguments after the
    call, on the CPU, after vLLM's semantics are checked."""
    args = _inputs(case)
    if device == "cpu":
        raw = _copy(args)
        _call(case, args)
        _check_vllm(case, raw, args)
        _check_direct(case, raw, args)
        return args
    request.getfixturevalue("_gpu_variants_built")
    _poison(args)
    raw = _copy(args)
    refs = []
    for invert in (False, True):
        ref = _copy(raw)
        if invert:
            for name in MUTATED[1:]:
                if ref.get(name) is not None:
                    ref[name].view(torch.uint8).bitwise_not_()
        _call(case, ref)
        refs.append(ref)
    got = _copy(raw, "cuda")
    _call(case, got)
    torch.cuda.synchronize()
    got = _copy(got)
    for name in MUTATED:
        if raw.get(name) is not None:
            compare(name, *(_fp8_as_float8(t[name]) for t in (got, *refs)))
    _check_vllm(case, raw, got)
    return got


def _cases(space):
    """pytest params (device, *p) for each tuple p of space (its first element: N): on the CPU
    but for N=513, and on the GPU (marked gpu)."""
    params = []
    for p in space:
        ident = "-".join(str(x) for x in p)
        if p[0] != 513:
            params.append(pytest.param("cpu", *p, id=f"cpu-{ident}"))
        params.append(pytest.param("cuda", *p, id=f"cuda-{ident}", marks=pytest.mark.gpu))
    return params


NS = (1, 7, 64, 513)
DENSE = [(n, nq, nkv) for n in NS for nq, nkv in ((8, 2), (16, 4), (64, 4))]
DENSE_Q_FP8 = [(n,) for n in NS]
FULL = [(n, bs, dt, q_fp8) for n in NS for bs in (16, 64) for dt in ("auto", "fp8") for q_fp8 in (False, True)]
SKIP = [(n, bs, dt) for n in (1, 64, 513) for bs in (16, 64) for dt in ("auto", "fp8")]
FP8_INDEX = [(n, bs) for n in NS for bs in (16, 64)]
NHD = [(n, bs, dt) for n in NS for bs in (16, 64) for dt in ("auto", "fp8")]
PROFILE = [(n,) for n in NS]


def _dense_cases(n, nq, nkv):
    return [Case("dense", n, nq, nkv, niq=0)]


def _dense_q_fp8_cases(n):
    first = Case("dense", n, niq=0, q_out=True, q_fp8=True)
    return [first, dataclasses.replace(first, q_out=False)]


def _full_cases(n, bs, dt, q_fp8):
    first = Case("full", n, block_size=bs, kv_cache_dtype=dt, q_out=True, q_fp8=q_fp8)
    return [first, dataclasses.replace(first, q_out=False)] if q_fp8 else [first]


def _skip_cases(n, bs, dt):
    return [Case("skip", n, block_size=bs, kv_cache_dtype=dt, q_out=True)]


def _fp8_index_cases(n, bs):
    bf16 = Case("full", n, block_size=bs, q_out=True)
    return [bf16, dataclasses.replace(bf16, index_fp8=True)]


def _nhd_cases(n, bs, dt):
    hnd = Case("full", n, block_size=bs, kv_cache_dtype=dt, q_out=True)
    return [hnd, dataclasses.replace(hnd, nhd=True)]


def _profile_cases(n):
    return [Case("profile", n), Case("full", n, q_out=True, index_slots=False)]


SUITES = ((DENSE, _dense_cases), (DENSE_Q_FP8, _dense_q_fp8_cases), (FULL, _full_cases), (SKIP, _skip_cases),
          (FP8_INDEX, _fp8_index_cases), (NHD, _nhd_cases), (PROFILE, _profile_cases))


@pytest.fixture(scope="module")
def _gpu_variants_built():
    """Every variant the GPU cases call, derived by validating each call's native arguments
    (made by the drop-in on CPU tensors, not run), built at once in parallel."""
    variants = {}
    signature = inspect.signature(api.fused_qknorm_rope_cache)

    def derive(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        variant, _ = check(**{name: bound.arguments[name] for name in CALL_NAMES}, outputs=False)
        variants[variant.uri] = variant

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_compat, "fused_qknorm_rope_cache", derive)
        for space, cases in SUITES:
            for p in space:
                for case in cases(*p):
                    _call(case, _inputs(case))
    build.build_many([build.Job(uri, source_of(v)) for uri, v in sorted(variants.items())], toolchain.default())


# ---- vLLM's tests ----------------------------------------------------------------------
@pytest.mark.parametrize("device,n,nq,nkv", _cases(DENSE))
def test_dense_norm_rope(device, n, nq, nkv, request):
    """vLLM's dense layer: q and K normed and rotated in place, V untouched, no cache."""
    _run(_dense_cases(n, nq, nkv)[0], device, request)


@pytest.mark.parametrize("device,n", _cases(DENSE_Q_FP8))
def test_dense_q_fp8(device, n, request):
    """q_fp8_out beside q_out, then without it: q written only as FP8 (qkv's q kept), the
    same FP8 bytes and the same K."""
    with_q, fp8_only = (_run(c, device, request) for c in _dense_q_fp8_cases(n))
    for name in ("qkv", "q_fp8_out"):
        _assert_same(fp8_only[name], with_q[name], f"{name}: FP8 only against beside q_out")


@pytest.mark.parametrize("device,n,block_size,kv_cache_dtype,q_fp8", _cases(FULL))
def test_sparse_full(device, n, block_size, kv_cache_dtype, q_fp8, request):
    """vLLM's sparse layer (its positional call): K and V into the cache at slot_mapping,
    index_k into the index cache at index_slot_mapping, q and index_q into their buffers;
    with q_fp8_out, a second call without q_out writes the same bytes everywhere (vLLM R4)."""
    runs = [_run(c, device, request) for c in _full_cases(n, block_size, kv_cache_dtype, q_fp8)]
    for later in runs[1:]:
        for name in ("qkv", "q_fp8_out", "index_q_out", "kv_cache", "index_cache"):
            _assert_same(later[name], runs[0][name], f"{name}: without q_out against with it")


@pytest.mark.parametrize("device,n,block_size,kv_cache_dtype", _cases(SKIP))
def test_sparse_skip_index_branch(device, n, block_size, kv_cache_dtype, request):
    """skip_index_branch: the index slices of qkv and the (random) index cache unchanged,
    index weights not passed; q, K, V and the KV cache as in the full mode."""
    _run(_skip_cases(n, block_size, kv_cache_dtype)[0], device, request)


@pytest.mark.parametrize("device,n,block_size", _cases(FP8_INDEX))
def test_sparse_full_fp8_index(device, n, block_size, request):
    """An FP8 index cache and index_q_out: the main branch bit-identical to the bf16-index
    call's; index_q and the index cache close to its (vLLM: rtol 0.13, atol 0.05) and
    within one FP8 code of its values quantized."""
    bf16, fp8 = (_run(c, device, request) for c in _fp8_index_cases(n, block_size))
    for name in ("qkv", "q_out", "kv_cache"):
        _assert_same(fp8[name], bf16[name], f"{name}: FP8 index against bf16 index")
    _close(fp8["index_q_out"], bf16["index_q_out"], 0.13, "FP8 index_q_out", atol=0.05)
    _assert_fp8_close(fp8["index_q_out"], bf16["index_q_out"].to(FP8), "FP8 index_q_out")
    slots = torch.roll(_inputs(_fp8_index_cases(n, block_size)[0])["slot_mapping"], 1)
    got, want = fp8["index_cache"].view(-1, HEAD_DIM)[slots], bf16["index_cache"].view(-1, HEAD_DIM)[slots]
    _close(got, want, 0.13, "FP8 index cache", atol=0.05)
    _assert_fp8_close(got, want.to(FP8), "FP8 index cache")


@pytest.mark.parametrize("device,n,block_size,kv_cache_dtype", _cases(NHD))
def test_sparse_full_nhd_cache(device, n, block_size, kv_cache_dtype, request):
    """A cache whose strides put a block's slots before its heads (vLLM's NHD backends): the
    same elements, logically, as the contiguous (HND) cache's, and the same outputs."""
    hnd, nhd = (_run(c, device, request) for c in _nhd_cases(n, block_size, kv_cache_dtype))
    assert nhd["kv_cache"].stride(1) == 2 * HEAD_DIM  # (the NHD strides survived the copies)
    slots = _inputs(_nhd_cases(n, block_size, kv_cache_dtype)[0])["slot_mapping"]
    block, off = slots // block_size, slots % block_size
    _assert_same(nhd["kv_cache"][block, :, off], hnd["kv_cache"][block, :, off], "NHD cache against HND")
    for name in ("qkv", "q_out", "index_q_out"):
        _assert_same(nhd[name], hnd[name], f"{name}: NHD against HND")


@pytest.mark.parametrize("device,n", _cases(PROFILE))
def test_sparse_without_caches_and_default_index_slots(device, n, request):
    """Sparse rows without kv_cache (vLLM's profiling instantiation): q, K, index_q and
    index_k in place, nothing else; and index_slot_mapping left out, which is slot_mapping."""
    for case in _profile_cases(n):
        _run(case, device, request)


# ---- the drop-in itself (CPU) -----------------------------------------------------------
def test_the_argument_list_is_upstreams():
    """vllm/_custom_ops.py's fused_minimax_m3_qknorm_rope_kv_insert: names, order, defaults."""
    upstream = [("qkv", None), ("q_norm_weight", None), ("k_norm_weight", None), ("cos_sin_cache", None),
                ("positions", None), ("num_heads", None), ("num_kv_heads", None), ("rotary_dim", None),
                ("eps", None), ("index_q_norm_weight", None), ("index_k_norm_weight", None),
                ("num_index_heads", 0), ("slot_mapping", None), ("index_slot_mapping", None), ("kv_cache", None),
                ("index_cache", None), ("block_size", 0), ("q_out", None), ("index_q_out", None),
                ("kv_cache_dtype", "auto"), ("skip_index_branch", False), ("q_fp8_out", None),
                ("q_fp8_scale", 1.0)]
    params = inspect.signature(fused_minimax_m3_qknorm_rope_kv_insert).parameters.values()
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params] == upstream
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    assert inspect.signature(fused_minimax_m3_qknorm_rope_kv_insert).return_annotation in (None, "None")


def _same_call(case: Case, change) -> None:
    """The case's call with its arguments changed by `change(args)` writes what it wrote before."""
    want = _inputs(case)
    _call(case, want)
    got = _inputs(case)
    _call(case, change(got) or got)
    for name in MUTATED:
        if want.get(name) is not None:
            _assert_same(got[name], want[name], name)


def test_an_fp8_cache_may_be_float8_e4m3fn_storage():
    _same_call(Case("full", 7, kv_cache_dtype="fp8", q_out=True),
               lambda a: a.update(kv_cache=a["kv_cache"].view(FP8)))


def test_fp8_e4m3_is_fp8():
    _same_call(Case("full", 7, kv_cache_dtype="fp8", q_out=True), lambda a: a.update(kv_cache_dtype="fp8_e4m3"))


def test_longer_positions_and_slot_mappings_are_read_for_the_first_tokens():
    """vLLM's kernel reads entry t for token t and checks no length (index slots: the main ones')."""
    def longer(a):
        extra = torch.tensor([5, 6, 7])
        return dict(a, positions=torch.cat([a["positions"], extra]), slot_mapping=torch.cat([a["slot_mapping"], extra]),
                    index_slot_mapping=torch.cat([a["index_slot_mapping"], extra]))
    _same_call(Case("full", 7, q_out=True), longer)
    _same_call(Case("dense", 7, niq=0), lambda a: a.update(positions=torch.cat([a["positions"], torch.arange(3)])))


def test_outputs_of_any_shape_with_the_right_size():
    """vLLM takes contiguous outputs by their element count: q [N * nq, D] and flat ones."""
    def reshaped(a):
        return dict(a, q_out=a["q_out"].view(-1, HEAD_DIM), index_q_out=a["index_q_out"].view(-1),
                    q_fp8_out=a["q_fp8_out"].view(7, 16, HEAD_DIM))
    _same_call(Case("full", 7, q_out=True, q_fp8=True), reshaped)


def test_the_index_cache_is_addressed_flat_by_slot():
    """vLLM writes index_k at row `slot` of the index cache, whatever its shape: [slots, D]
    and pages of a size the contract does not list (8) hold what [blocks, block_size, D] does."""
    case = Case("full", 7, block_size=16, q_out=True)
    want = _inputs(case)
    _call(case, want)
    for shape in ((-1, HEAD_DIM), (-1, 8, HEAD_DIM)):
        got = _inputs(case)
        got["index_cache"] = got["index_cache"].view(shape)
        _call(case, got)
        _assert_same(got["index_cache"].view(want["index_cache"].shape), want["index_cache"], f"{shape}")


def test_index_arguments_it_does_not_read_are_ignored():
    """vLLM reads no index tensor on dense rows or with skip_index_branch (index weights,
    slots, cache), and no slots or index cache without kv_cache."""
    junk = torch.ones(3)
    _same_call(Case("dense", 7, niq=0), lambda a: a.update(index_q_norm_weight=junk, index_k_norm_weight=junk,
                                                             index_slot_mapping=junk, index_cache=junk,
                                                             slot_mapping=junk, block_size=5))
    _same_call(Case("skip", 7, q_out=True), lambda a: a.update(index_q_norm_weight=junk, index_k_norm_weight=junk,
                                                             index_slot_mapping=junk))
    _same_call(Case("profile", 7), lambda a: a.update(slot_mapping=junk, index_slot_mapping=junk, index_cache=junk,
                                                      block_size=3, kv_cache_dtype="fp8_e5m2"))


def test_calls_without_caches_reuse_their_dummies():
    """The one-page cache (and index cache, and empty slot mapping) of a call that inserts
    nothing is made once per device, dtype and shape; the q_fp8_scale tensor once per value."""
    kept = (engine_args._scratch_kv, engine_args._scratch_index, engine_args._no_slots, vllm_compat._scale_tensor)
    for case in (Case("dense", 3, niq=0, q_out=True, q_fp8=True), Case("profile", 3)):
        _call(case, _inputs(case))
        made = [f.cache_info().currsize for f in kept]
        _call(case, _inputs(case))
        assert [f.cache_info().currsize for f in kept] == made  # the same key is the same object
    assert all(f.cache_info().currsize for f in kept)


def _full7(**change) -> tuple[Case, dict]:
    case = Case("full", 7, q_out=True)
    return case, dict(_inputs(case), **change)


BAD = [
    pytest.param(lambda: _full7(block_size=64), ValueError, r"block_size: expected 16 \(kv_cache\.size\(2\)\), got 64",
                 id="block_size"),
    pytest.param(lambda: _full7(block_size=0), ValueError, r"block_size: expected 16 \(kv_cache\.size\(2\)\), got 0",
                 id="block_size-default"),
    pytest.param(lambda: _full7(kv_cache_dtype="fp8_e5m2"), ValueError,
                 r"kv_cache_dtype: expected 'auto', 'fp8' or 'fp8_e4m3' \(an e5m2 cache is not supported\), "
                 r"got 'fp8_e5m2'", id="fp8_e5m2"),
    pytest.param(lambda: _full7(kv_cache_dtype="int8"), ValueError,
                 r"kv_cache_dtype: expected one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', got 'int8'",
                 id="kv_cache_dtype"),
    *(pytest.param(lambda s=s: _full7(q_fp8_out=torch.zeros(7, 16 * HEAD_DIM, dtype=FP8), q_fp8_scale=s),
                   ValueError, rf"q_fp8_scale: expected a finite positive float, got {s!r}", id=f"q_fp8_scale={s}")
      for s in (0.0, -0.5, math.inf, math.nan)),
    pytest.param(lambda: (Case("skip", 7, q_out=True),
                          dict(_inputs(Case("skip", 7, q_out=True)), index_q_out=torch.zeros(7, 4 * HEAD_DIM, dtype=DTYPE))),
                 ValueError, r"index_q_out: expected None \(skip_index_branch=True: the index branch is not "
                             r"processed\), got a bfloat16 tensor of shape \(7, 512\)", id="index_q_out-skip"),
    pytest.param(lambda: (Case("dense", 7, niq=0), dict(_inputs(Case("dense", 7, niq=0)), skip_index_branch=True)),
                 ValueError, r"skip_index_branch: expected False \(num_index_heads=0: dense rows have no index "
                             r"heads to skip\), got True", id="skip-dense"),
    pytest.param(lambda: (Case("dense", 7, niq=0), dict(_inputs(Case("dense", 7, niq=0)), block_size=16,
                                                        kv_cache=torch.zeros(2, 4, 16, 256, dtype=DTYPE),
                                                        slot_mapping=torch.arange(7))),
                 ValueError, r"kv_cache: expected None \(num_index_heads=0: vLLM's op inserts", id="kv_cache-dense"),
    pytest.param(lambda: _full7(kv_cache=torch.zeros(2, 4, 16, 256, dtype=torch.uint8)), TypeError,
                 r"kv_cache: expected dtype bfloat16 \(the dtype of qkv, kv_cache_dtype='auto'\), got uint8",
                 id="auto-uint8"),
    pytest.param(lambda: _full7(kv_cache=torch.zeros(2, 2, 16, 4, 128, dtype=DTYPE)), ValueError,
                 r"kv_cache: expected a 4-D tensor \[num_blocks, num_kv_heads, block_size, 2 \* head_dim\], "
                 r"got shape \(2, 2, 16, 4, 128\)", id="kv_cache-5d"),
    pytest.param(lambda: _full7(index_cache=torch.zeros(2, 16, 128, dtype=FP8), index_q_out=None), ValueError,
                 r"index_q_out: expected a float8_e4m3fn tensor \(index_cache is FP8", id="fp8-index-in-place"),
    # the native call's checks, by the same names
    pytest.param(lambda: _full7(kv_cache=torch.zeros(2, 3, 16, 256, dtype=DTYPE)), ValueError,
                 r"kv_cache: expected shape \[pages, 4, \d+, 256\] for contract vllm_m3", id="kv_cache-heads"),
    pytest.param(lambda: _full7(index_cache=None), ValueError,
                 r"index_cache: expected a tensor \(required with index_mode 'full'\), got None", id="no-index_cache"),
]


@pytest.mark.parametrize("make,error,message", BAD)
def test_bad_input_is_refused_before_anything_is_written(make, error, message):
    case, args = make()
    raw = _copy(args)
    with pytest.raises(error, match=rf"^{message}"):
        _call(case, args)
    for name in MUTATED:
        if isinstance(raw.get(name), torch.Tensor):
            _assert_same(args[name], raw[name], f"{name} after a refused call")
