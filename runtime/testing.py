"""Realistic inputs for a variant: used by the tests and the benchmarks alike.

Slot mappings follow SPEC §8: `prefill` puts a few sequences on randomly chosen
free pages, each sequence's tokens on consecutive slots; `decode` puts each token
on its own random page at a random offset; `random` scatters tokens over all
slots (a stress case). `pad` marks some tokens -1 as CUDA-graph padding does.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from kvforge.codegen import signature
from kvforge.codegen.layout import access
from kvforge.codegen.model import IndexMode, KvScale, QFp8, Variant

from .reference import FP8_DTYPES

_MODEL = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sample_variants(variants, must: tuple[Variant, ...] = ()) -> list[Variant]:
    """A few variants that still meet every contract and each FP8 flavour of the KV cache:
    the fast tier's compile checks; the slow tier takes them all."""
    chosen = {v.uri: v for v in must}
    for key in (lambda v: v.contract.name, lambda v: v.fp8 if v.kv_fp8 else None):
        seen = set()
        for v in variants:
            if key(v) is not None and key(v) not in seen:
                seen.add(key(v))
                chosen.setdefault(v.uri, v)
    return sorted(chosen.values(), key=lambda v: v.uri)


def rope_cos_sin(max_pos: int, rotary_dim: int, theta: float, dtype: torch.dtype,
                 device="cpu") -> torch.Tensor:
    """A real NeoX cos/sin table [max_pos, rotary_dim] = [cos | sin]."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).to(dtype).to(device)


def slot_mapping(kind: str, num_tokens: int, page_size: int, num_pages: int,
                 gen: torch.Generator, seq_len: int = 0) -> torch.Tensor:
    """Slots for `num_tokens` tokens in a cache of num_pages pages (see module doc)."""
    perm = torch.randperm(num_pages, generator=gen)
    if kind == "decode":
        if num_tokens > num_pages:
            raise ValueError("decode slots need a page per token")
        offs = torch.randint(0, page_size, (num_tokens,), generator=gen)
        return perm[:num_tokens] * page_size + offs
    if kind == "random":
        return torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    if kind != "prefill":
        raise ValueError(f"slot kind: expected prefill, decode or random, got {kind!r}")
    seq_len = seq_len or max(1, min(num_tokens, 2048))
    out, next_page = [], 0
    for start in range(0, num_tokens, seq_len):
        n = min(seq_len, num_tokens - start)
        pages = perm[next_page:next_page + math.ceil(n / page_size)]
        next_page += pages.numel()
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
        out.append(slots[:n])
    return torch.cat(out)


def pages_needed(kind: str, num_tokens: int, page_size: int, seq_len: int = 0) -> int:
    if kind == "decode":
        return num_tokens
    if kind == "random":
        return math.ceil(num_tokens / page_size)
    seq_len = seq_len or max(1, min(num_tokens, 2048))
    full, rest = divmod(num_tokens, seq_len)
    return full * math.ceil(seq_len / page_size) + (math.ceil(rest / page_size) if rest else 0)


def make_cache(v: Variant, role: str, pages: int, dtype: torch.dtype, device,
               page_stride_pad: int = 0) -> torch.Tensor:
    """A cache tensor for `role` with `pages` pages. With page_stride_pad > 0 the free
    page stride is larger than the page (a view into a bigger allocation); for a cache
    whose run-time extent counts slots (a scale cache [nkv, slots]) the head stride is."""
    acc = access(v, role)
    runtime = pages * (acc.page_size if acc.counts_slots else 1)
    shape = [runtime if e is None else e for e in acc.extents]
    if not page_stride_pad or not acc.free:
        return torch.empty(shape, dtype=dtype, device=device)
    if acc.runtime_dim != 0:  # [.., slots]: the slots of each head followed by a gap
        wide = list(shape)
        wide[acc.runtime_dim] += page_stride_pad * 4
        return torch.empty(wide, dtype=dtype, device=device).narrow(acc.runtime_dim, 0, runtime)
    # Allocate [pages, 1 + pad/page] pages and view the first of each: a free page stride.
    page_elems = math.prod(s for i, s in enumerate(shape) if i != acc.runtime_dim)
    pad = page_stride_pad * max(1, 16 // torch.empty((), dtype=dtype).element_size())
    base = torch.empty((pages, page_elems + pad), dtype=dtype, device=device)
    return base[:, :page_elems].view(shape)


def make_inputs(v: Variant, num_tokens: int, num_heads: int, num_index_heads: int, *,
                slots: str = "prefill", pad: int = 0, device="cpu", seed: int = 0,
                extra_pages: int = 3, max_pos: int = 4096, cos_sin: str = "trig",
                page_stride_pad: int = 0, num_slots: Optional[int] = None) -> dict:
    """Keyword arguments for `fused_qknorm_rope_cache` (outputs not included).

    `pad` tokens at the end get slot -1; `num_slots` < num_tokens shortens the slot
    mappings (tokens past it write no cache). `cos_sin='random'` draws the table.
    """
    gen = torch.Generator().manual_seed(seed)
    model = _MODEL[v.dtype.value]
    D, nkv = v.head_dim, v.num_kv_heads
    full = v.index_mode is IndexMode.FULL
    row_heads = num_heads + 2 * nkv + (num_index_heads + 1 if v.index_mode is not IndexMode.NONE else 0)
    # The big input is drawn where it will live (a GPU draws 1 GB in milliseconds).
    dev_gen = gen if torch.device(device).type == "cpu" else torch.Generator(device).manual_seed(seed)
    qkv = (torch.randn((num_tokens, row_heads * D), generator=dev_gen, device=device) * 2.0).to(model)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    cs_dtype = _MODEL[v.cos_sin.value]
    if cos_sin == "trig":
        table = rope_cos_sin(max_pos, v.rotary_dim, 5e6, cs_dtype)
    else:
        table = (torch.rand((max_pos, v.rotary_dim), generator=gen) * 2 - 1).to(cs_dtype)

    def weight() -> torch.Tensor:
        return (torch.randn(D, generator=gen) * 0.2).to(model)

    kv_dtype = FP8_DTYPES[v.fp8] if v.kv_scale is not KvScale.NONE else model
    ps = v.page_size("k")
    n_real = num_tokens if num_slots is None else num_slots
    kv_pages = pages_needed(slots, n_real, ps) + extra_pages
    sm = slot_mapping(slots, n_real, ps, kv_pages, gen)
    if pad:
        sm[max(0, n_real - pad):] = -1
    args = dict(
        qkv=qkv, positions=positions, cos_sin_cache=table, slot_mapping=sm,
        q_norm_weight=weight(), k_norm_weight=weight(), num_heads=num_heads, num_kv_heads=nkv,
        rotary_dim=v.rotary_dim, eps=1e-6, num_index_heads=num_index_heads,
        **{a.name: v.axes()[a.axis] for a in signature.ARGS if a.kind is signature.Kind.CHOICE},  # contract, options
    )
    if v.contract.combined_kv:
        args["kv_cache"] = make_cache(v, "k", kv_pages, kv_dtype, "cpu", page_stride_pad)
    else:
        args["k_cache"] = make_cache(v, "k", kv_pages, kv_dtype, "cpu", page_stride_pad)
        args["v_cache"] = make_cache(v, "v", kv_pages, kv_dtype, "cpu", page_stride_pad)
    if v.kv_scale in (KvScale.PER_TENSOR, KvScale.PER_HEAD):
        n = 1 if v.kv_scale is KvScale.PER_TENSOR else nkv
        args["k_scale"] = torch.rand(n, generator=gen) * 0.5 + 0.05
        args["v_scale"] = torch.rand(n, generator=gen) * 0.5 + 0.05
    if v.kv_scale.dynamic:  # written by the call (an output-like cache)
        for role in ("k_scale", "v_scale"):
            args[f"{role}_cache"] = make_cache(v, role, kv_pages, torch.float32, "cpu", page_stride_pad)
    if v.q_fp8 is not QFp8.NONE:  # the FP8 query output (an output), q_out beside it
        args["q_fp8_scale"] = torch.rand(1, generator=gen) * 0.05 + 0.005
        args["q_fp8_out"] = torch.empty((num_tokens, num_heads, D), dtype=FP8_DTYPES[v.fp8])
    if full:
        ips = v.page_size("index")
        idx_dtype = FP8_DTYPES[v.fp8] if v.index_fp8 else model
        own = v.contract.index_slots.value == "own"
        i_pages = (pages_needed(slots, n_real, ips) + extra_pages) if own else kv_pages
        args.update(index_q_norm_weight=weight(), index_k_norm_weight=weight(),
                    index_cache=make_cache(v, "index", i_pages, idx_dtype, "cpu", page_stride_pad))
        if own:
            ism = slot_mapping(slots, n_real, ips, i_pages, gen)
            if pad:
                ism[max(0, n_real - pad):] = -1
            args["index_slot_mapping"] = ism
    return {k: (val.to(device) if isinstance(val, torch.Tensor) else val) for k, val in args.items()}


MUTABLE = signature.MUTABLE  # the arguments the op writes


def v_loop_tokens(v: Variant, items: int, device=0) -> int:
    """A prefill in which every group of the kernel's V loop writes at least `items` items
    (8 tokens of one kv head; FP8's two groups share a run of 16, so as many runs per
    pair), plus a partial last one, on this GPU: the grid is one wave of blocks of 256
    threads, at most as many per SM as it holds threads (2 or 3 in fact), each of
    256 / (head_dim / 8) groups."""
    props = torch.cuda.get_device_properties(device)
    groups = props.multi_processor_count * (props.max_threads_per_multi_processor // 256) * (256 * 8 // v.head_dim)
    return items * groups * 8 // v.num_kv_heads + 5


def _base(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _copy_args(args: dict, device, invert: bool) -> dict:
    """args with every tensor re-created on `device` over a copy of its whole allocation
    (padding included; views of one allocation stay views of one copy). With `invert`,
    the outputs' and caches' bytes are complemented."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for key, t in args.items():
        if not isinstance(t, torch.Tensor):
            out[key] = t
            continue
        base = _base(t)
        if id(base) not in copies:
            copies[id(base)] = base.detach().to(device, copy=True)
            if invert and key in MUTABLE:
                copies[id(base)].view(torch.uint8).bitwise_not_()
        out[key] = copies[id(base)].as_strided(t.size(), t.stride(), t.storage_offset())
    return out


def with_outputs(args: dict) -> dict:
    """args plus allocated q_out (and index_q_out in full mode), as the API would; an output
    args name (None included: q_fp8_out then stands alone) is kept."""
    qkv, D = args["qkv"], args["q_norm_weight"].numel()
    out = dict(args)
    if "q_out" not in args:
        out["q_out"] = qkv.new_empty((qkv.shape[0], args["num_heads"], D))
    if ("index_q_out" not in args and args.get("index_mode", "full") == "full"
            and args.get("index_cache") is not None):
        out["index_q_out"] = torch.empty((qkv.shape[0], args["num_index_heads"], D),
                                         dtype=args["index_cache"].dtype, device=qkv.device)
    return out


def poison(args: dict, seed: int = 1) -> None:
    """Fill every cache and output (whole allocations) with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    for key in MUTABLE:
        t = args.get(key)
        if t is None:
            continue
        base = _base(t)
        raw = torch.randint(0, 256, (base.numel() * base.element_size(),), generator=gen,
                            dtype=torch.uint8)
        base.view(torch.uint8).view(-1).copy_(raw.to(base.device))


class ReferenceCheck:
    """The reference for one input set, run once, against which kernels are then checked:
    each check restores the outputs' and caches' poison, runs the kernel and compares
    every byte (see `check_against_reference`), and fails a kernel that wrote into one of
    its inputs, whose next checks would run on changed inputs. The tuner checks every
    launch of a count this way: poisoning and the reference cost seconds a launch at
    65536 tokens."""

    def __init__(self, args: dict, seed: int = 1, ref_device="cpu"):
        from .api import reference_qknorm_rope_cache

        self.args = with_outputs(args)
        poison(self.args, seed)
        bases = {id(_base(t)): _base(t) for key in MUTABLE if (t := self.args.get(key)) is not None}
        self._poisoned = [(base, base.clone()) for base in bases.values()]
        inputs = {id(_base(t)): (key, _base(t)) for key, t in self.args.items()
                  if isinstance(t, torch.Tensor) and id(_base(t)) not in bases}
        self._inputs = [(key, base, base.clone()) for key, base in inputs.values()]
        self._refs = []
        for invert in (False, True):
            ref = _copy_args(self.args, ref_device, invert)
            reference_qknorm_rope_cache(**ref)
            self._refs.append({key: ref[key] for key in MUTABLE if ref.get(key) is not None})  # the inputs' copies freed

    def __call__(self, run, max_ulp: Optional[dict] = None) -> dict:
        """Run `run(**args)` on the poisoned outputs; per-tensor statistics (see `compare`;
        `max_ulp` widens the bar of the outputs it names, for an oracle that rounds otherwise:
        within that many ulp, none need be bit-identical)."""
        for base, saved in self._poisoned:
            base.copy_(saved)
        run(**self.args)
        for key, base, saved in self._inputs:
            if not torch.equal(base.view(torch.uint8), saved.view(torch.uint8)):
                base.copy_(saved)
                raise AssertionError(f"{key}: the kernel wrote into this input")
        wide = max_ulp or {}
        return {key: compare(key, _base(self.args[key]), _base(self._refs[0][key]), _base(self._refs[1][key]),
                             min_identical=0.0 if key in wide else 0.99, max_ulp=wide.get(key, 1))
                for key in MUTABLE if self.args.get(key) is not None}


def check_against_reference(args: dict, run, seed: int = 1, ref_device="cpu", max_ulp: Optional[dict] = None) -> dict:
    """Run `run(**args)` (the kernel) on poisoned outputs and compare every byte of every
    output and cache with the reference run on the same and on the complementary poison
    (see `compare`), on `ref_device`. Returns per-tensor statistics."""
    return ReferenceCheck(args, seed, ref_device)(run, max_ulp)


# ---- comparison at the bar of SPEC §6 ---------------------------------------------
def _ordered(bits: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Sign-magnitude float codes → integers that step by one per representable value."""
    bits = bits.to(torch.int64) & ((1 << (8 * nbytes)) - 1)
    sign = 1 << (8 * nbytes - 1)
    mag = bits & (sign - 1)
    return torch.where(bits & sign != 0, -mag, mag)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, ref_other_poison: torch.Tensor,
            min_identical: float = 0.99, max_ulp: int = 1) -> dict:
    """Check one output against the reference, element by element.

    `ref` and `ref_other_poison` are the reference run on two complementary poisons:
    elements equal in both were written (addressed); the others must keep their poison
    byte for byte. Addressed elements must be within `max_ulp` units in the last place
    (SPEC §6: one), at least `min_identical` of them bit-identical, and never NaN where the
    reference is not. Raises AssertionError with a short description; returns statistics.
    """
    n = got.element_size()
    iv = _INT_VIEW[n]
    got = got.detach().to(ref.device)  # compare where the reference lives
    g, r, r2 = (x.contiguous().view(iv).flatten() for x in (got, ref, ref_other_poison))
    addressed = r == r2
    untouched_bad = (~addressed) & (g != r)
    if bool(untouched_bad.any()):
        i = int(untouched_bad.nonzero()[0])
        raise AssertionError(f"{name}: element {i} is not addressed but was written "
                             f"({int(untouched_bad.sum())} such elements)")
    gv, rv = g[addressed], r[addressed]
    if gv.numel() == 0:
        return {"addressed": 0, "identical": 1.0}
    diff = (_ordered(gv, n) - _ordered(rv, n)).abs()
    if got.dtype.is_floating_point:
        gf = got.contiguous().flatten()[addressed].float()
        rf = ref.contiguous().flatten()[addressed].float()
        nan = gf.isnan() & ~rf.isnan()
        if bool(nan.any()):
            raise AssertionError(f"{name}: {int(nan.sum())} NaN where the reference has none")
    worst = int(diff.max())
    identical = float((diff == 0).float().mean())
    if worst > max_ulp:
        i = int(diff.argmax())
        raise AssertionError(f"{name}: {int((diff > max_ulp).sum())} elements differ by more than {max_ulp} ulp "
                             f"(worst {worst} ulp at addressed element {i})")
    if identical < min_identical:
        raise AssertionError(f"{name}: only {identical:.2%} of elements bit-identical")
    return {"addressed": int(gv.numel()), "identical": identical}
