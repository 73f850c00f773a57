"""Every variant in variants.yaml against the reference on the GPU (SPEC §6)."""
import dataclasses
import functools
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from benchmarks.tune import launches
from kvforge.codegen.layout import access
from kvforge.codegen.model import IndexMode, Rope
from kvforge.runtime import build, fused_qknorm_rope_cache, toolchain
from kvforge.runtime.abi import V_LOOP_MIN_TOKENS, V_LOOP_OFF, V_LOOP_ON
from kvforge.runtime.api import launch_with
from kvforge.runtime.registry import spec, source_of
from kvforge.runtime.testing import (ReferenceCheck, check_against_reference, make_inputs, poison,
                                     sample_variants, v_loop_tokens, with_outputs)
from kvforge.runtime.tuning import Launch, TuningError

pytestmark = pytest.mark.gpu
VARIANTS = spec().variants


def _build_all(tc: toolchain.Toolchain) -> None:
    build.build_many([build.Job(v.uri, source_of(v)) for v in VARIANTS], tc)


@pytest.fixture(autouse=True, scope="module")
def _every_variant_built():
    """Every listed variant built before the first test, in parallel, not one at a time as
    tests first call it: a device's kernel cache is cold on every new machine."""
    _build_all(toolchain.default())


# (tokens, q heads, index heads, slots, padded tokens, extra options)
CASES = [
    pytest.param(1, 8, 2, "decode", 0, {}, id="t1-decode"),
    pytest.param(7, 8, 2, "prefill", 2, {"page_stride_pad": 1}, id="t7-prefill-pad-strided"),
    pytest.param(33, 16, 1, "random", 3, {"cos_sin": "random"}, id="t33-shuffled-randcs"),
    # scattered slots past the default V-loop threshold: an untuned SHUFFLE variant's V
    # loop writes every group by value (LAUNCH_CALLS run both V places for every variant)
    pytest.param(V_LOOP_MIN_TOKENS + 44, 8, 2, "random", 4, {}, id="t300-shuffled"),
    pytest.param(1000, 8, 4, "prefill", 0, {"num_slots": 990, "extra_pages": 0}, id="t1000-short-slots"),
    pytest.param(64, 64, 4, "decode", 5, {"extra_pages": 0}, id="t64-tp1-decode"),
]


# Calls every launch configuration runs: (tokens, q heads, slots, padded tokens,
# slot-mapping length). 3999 tokens of 8 q heads run a thread's pipeline through several
# tokens, each launch's grid being one wave (an H200 holds 3 x 132 blocks of 256 threads of
# one lane, 4 x 132 of 128 threads of two): at least two passes for every head_dim and lane
# count (at most ~2300 tokens per pass). 200 decode tokens of 64 q heads are several passes
# at one lane per thread (168-194 per pass at head_dim 128, fewer above; one pass at 64) and
# one at two (two at head_dim 256). A SHUFFLE V goes both ways in each:
# in the main loop a thread's second token reuses the row its group stages V through, the V
# loop meets prefill runs and decode's scattered slots. 11 decode tokens of 64 q heads fill
# fewer blocks of 256 than an H200 has SMs, so a launch of one lane per thread takes smaller
# blocks (64 threads at head_dim 64 and 128; few enough that blocks of 64 still number
# fewer than the SMs).
LAUNCH_CALLS = {"t3999-prefill": (3999, 8, "prefill", 7, 3990),
                "t201-tp1-decode": (201, 64, "decode", 5, 198),
                "t11-tp1-decode-small-blocks": (11, 64, "decode", 2, 9)}


def _launch_params(keep=lambda launch: True):
    """(variant, call, launch) for every launch configuration a tuned table may pick for
    each variant (the tuner's list: depths, tiles, lanes per thread, where V is transposed
    V in the main loop and in the V loop, and where K/V have per-token scales every count
    of groups per K/V head) that `keep` keeps, on every call of
    LAUNCH_CALLS; a variant's launches of one call are adjacent, so they share one
    reference (`_reference`)."""
    return [pytest.param(v, call, launch, id=f"{v.uri}-{call}-depth{launch.depth}-tile{launch.tile}"
                                             f"-vloop{launch.v_loop}-lanes{launch.lanes}-groups{launch.groups}")
            for v in VARIANTS for call in LAUNCH_CALLS for launch in launches(v) if keep(launch)]


@functools.lru_cache(maxsize=1)
def _reference(variant, call: str, seed: int) -> ReferenceCheck:
    """The inputs of LAUNCH_CALLS[call] for the variant and their reference, computed once
    for all its launches (the reference and the poison took most of these tests' time)."""
    tokens, nq, slots, pad, num_slots = LAUNCH_CALLS[call]
    niq = 0 if variant.index_mode is IndexMode.NONE else 2
    args = make_inputs(variant, tokens, nq, niq, slots=slots, pad=pad, device="cuda", seed=seed,
                       cos_sin="random", num_slots=num_slots)
    return ReferenceCheck(args, ref_device="cuda")


@pytest.fixture(scope="session", autouse=True)
def _prebuild():
    """Build every listed variant at once (ninja, all cores) before the first test."""
    tc = toolchain.default()
    build.build_many([build.Job(v.uri, source_of(v)) for v in VARIANTS], tc)


@pytest.mark.parametrize("tokens,nq,niq,slots,pad,opts", CASES)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.uri)
def test_variant_matches_reference(variant, tokens, nq, niq, slots, pad, opts):
    if variant.index_mode is IndexMode.NONE:
        niq = 0
    args = make_inputs(variant, tokens, nq, niq, slots=slots, pad=pad, device="cuda",
                       seed=zlib.crc32(f"{variant.uri}/{tokens}".encode()), **opts)
    if slots == "decode" and opts.get("extra_pages") == 0:
        # Every page holds one token; move the last page's token to the cache's last slot.
        cache = args.get("k_cache", args.get("kv_cache"))
        ps = variant.page_size("k")
        sm = args["slot_mapping"]
        last = (sm // ps == cache.shape[0] - 1).nonzero()
        if last.numel():
            sm[last[0]] = cache.shape[0] * ps - 1
    stats = check_against_reference(args, fused_qknorm_rope_cache)
    torch.cuda.synchronize()
    assert stats["q_out"]["addressed"] == tokens * nq * variant.head_dim


@pytest.mark.parametrize("variant,call,launch", _launch_params())
def test_every_launch_configuration_matches_reference(variant, call, launch):
    """The tuned table may pick any depth a library holds, any tile and either place for
    a transposed V, for any token count (LAUNCH_CALLS): each thread runs the pipeline
    through several tokens, or a call takes blocks smaller than 256 threads; the last
    tokens padded, past the slots, or alone in their tile (3999, 201 and 11 tokens leave
    1 or 3 in the last tile of 2 or 4)."""
    _reference(variant, call, 21)(lambda **a: launch_with(launch, **a)())


@pytest.fixture(scope="module")
def register_pipeline():
    """The toolchain that builds the kernels with rows waiting in registers, as on AMD
    (KVF_ASYNC_COPY=0), and every listed variant built so: on NVIDIA the kernel
    otherwise waits for them in shared memory, and AMD is only compiled here."""
    tc = dataclasses.replace(toolchain.default(), defines=("KVF_ASYNC_COPY=0",))
    _build_all(tc)
    return tc


# AMD's pipeline at two lanes per thread: its row FIFO holds four chunks instead of two, the
# same code at every tile, so one tile (every depth and V place).
@pytest.mark.parametrize("variant,call,launch", _launch_params(lambda launch: launch.lanes == 1 or launch.tile == 2))
def test_register_pipeline_matches_reference(variant, call, launch, register_pipeline):
    """AMD's pipeline, run on the calls above (several tokens per thread, small blocks):
    the last tokens padded, past the slots, or past the end, where its row loads repeat
    the last row; a SHUFFLE V written in the main loop stored lane by lane, as AMD does
    (no staging without cp.async)."""
    _reference(variant, call, 22)(lambda **a: launch_with(launch, register_pipeline, **a)())


def test_two_lanes_per_thread_are_refused_where_the_variant_has_one():
    """rotary_dim 36: its halves of 18 dims are not whole chunks, so a lane exchanges
    partners with its neighbours and holds no second lane."""
    v = next(v for v in VARIANTS if v.rotary_dim == 36 and v.rope is Rope.NEOX)
    args = make_inputs(v, 4, 8, 2, slots="decode", device="cuda", seed=3)
    with pytest.raises(ValueError, match=rf"^launch_with: lanes must be at most 1 for {v.uri} "):
        launch_with(Launch(1, 2, 0, 2), **with_outputs(args))


def _seed_variant(**axes):
    want = {"contract": "vllm_shuffle16", "num_kv_heads": "4", "index_dtype": "model",
            "kv_scale": "none", **axes}
    want = {k: val for k, val in want.items() if val is not None}  # None: an axis the variant lacks
    return next(v for v in VARIANTS if all(v.axes().get(k) == str(val) for k, val in want.items()))


def _clone(args):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def _mutated(args, q, iq):
    keys = ("k_cache", "v_cache", "kv_cache", "index_cache")
    return [args[k] for k in keys if args.get(k) is not None] + [q] + ([iq] if iq is not None else [])


@pytest.mark.parametrize("kv_scale", ["none", "per_tensor"])
def test_torch_compile_fullgraph(kv_scale):
    v = _seed_variant(kv_scale=kv_scale)
    args = make_inputs(v, 37, 16, 2, slots="prefill", pad=4, device="cuda", seed=3)
    eager_args, comp_args = _clone(args), _clone(args)
    q_e, iq_e = fused_qknorm_rope_cache(**eager_args)

    @torch.compile(fullgraph=True)
    def step(qkv, positions, k_cache, v_cache, index_cache):
        q, iq = fused_qknorm_rope_cache(**dict(comp_args, qkv=qkv, positions=positions, k_cache=k_cache,
                                               v_cache=v_cache, index_cache=index_cache))
        return q * 1, iq  # something after the op, so the graph really contains it

    q_c, iq_c = step(comp_args["qkv"], comp_args["positions"], comp_args["k_cache"],
                     comp_args["v_cache"], comp_args["index_cache"])
    for a, b in zip(_mutated(eager_args, q_e, iq_e), _mutated(comp_args, q_c, iq_c)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_back_to_back_calls_read_what_the_previous_one_wrote(graph):
    """The launch overlaps the previous kernel (programmatic dependent launch on Hopper):
    a call whose qkv is the q_out the call before it is still writing must see all of it.
    The same second call, run again alone afterwards, must give the same bytes."""
    v = _seed_variant(index_mode="none", index_dtype=None)
    T = 8192
    first = with_outputs(make_inputs(v, T, 16, 0, slots="prefill", device="cuda", seed=7))
    second = make_inputs(v, T, 8, 0, slots="prefill", device="cuda", seed=8)
    second = with_outputs(dict(second, qkv=first["q_out"].view(T, -1)))
    for _ in range(3):
        poison(first, 3)
        poison(second, 4)  # q_out of the first call is the second's qkv: garbage until written
        before = _clone(second)
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fused_qknorm_rope_cache(**first)
                fused_qknorm_rope_cache(**second)
            poison(first, 3)
            poison(second, 4)
            g.replay()
        else:
            fused_qknorm_rope_cache(**first)
            fused_qknorm_rope_cache(**second)
        torch.cuda.synchronize()
        again = dict(before, qkv=first["q_out"].view(T, -1))
        fused_qknorm_rope_cache(**again)
        torch.cuda.synchronize()
        for key in ("q_out", "k_cache", "v_cache"):
            a, b = second[key].view(torch.uint8).flatten(), again[key].view(torch.uint8).flatten()
            bad = (a != b).nonzero().flatten()
            assert bad.numel() == 0, (f"iteration {_}: {key}: {bad.numel()} of {a.numel()} bytes differ, "
                                      f"first at {bad[:4].tolist()} last {bad[-1:].tolist()}")


def test_launch_with_reads_no_tuned_table(monkeypatch):
    """The tuner replaces a stale table, so a launch it names must not read one; a call
    that takes its launch from the table reports the table's error."""
    import kvforge.runtime.api

    def stale(device):
        raise TuningError(f"{device}: a stale table")

    monkeypatch.setattr(kvforge.runtime.api.tuning, "table_for", stale)
    monkeypatch.setattr(kvforge.runtime.api, "_PLANS", {})
    monkeypatch.setattr(kvforge.runtime.api.dispatch, "launch", lambda argv: False)  # no signature bound before
    v = _seed_variant()
    args = make_inputs(v, 13, 8, 2, slots="decode", device="cuda", seed=4)
    check_against_reference(args, lambda **a: launch_with(Launch(1, 2, V_LOOP_OFF), **a)(), ref_device="cuda")
    with pytest.raises(TuningError, match="a stale table"):
        fused_qknorm_rope_cache(**with_outputs(args))


def test_a_signature_validated_before_launches_from_the_table(monkeypatch):
    """The second call of a signature is not validated again; it writes with its own
    tensors' pointers, as the reference says."""
    import kvforge.runtime.api

    v = _seed_variant()
    fused_qknorm_rope_cache(**with_outputs(make_inputs(v, 16, 8, 2, slots="decode", device="cuda", seed=1)))

    check = kvforge.runtime.api.check

    def validated(**kwargs):  # the reference (on the CPU) still validates its calls
        assert kwargs["qkv"].device.type == "cpu", "a signature validated before was validated again"
        return check(**kwargs)

    monkeypatch.setattr(kvforge.runtime.api, "check", validated)
    for seed in (2, 3):
        check_against_reference(make_inputs(v, 16, 8, 2, slots="decode", device="cuda", seed=seed),
                                fused_qknorm_rope_cache)


def test_a_signature_validated_before_still_rejects_bad_calls():
    """After a good call, calls that differ only in what validation checks still raise
    before launching, and checked mode still reads the ranges."""
    v = _seed_variant()
    args = make_inputs(v, 16, 8, 2, slots="decode", device="cuda", seed=9)
    q_out = args["qkv"].new_empty((16, 8, v.head_dim))
    fused_qknorm_rope_cache(**args, q_out=q_out)
    flat = torch.empty(q_out.numel() + 8, dtype=q_out.dtype, device="cuda")
    with pytest.raises(ValueError, match="q_out: expected a 16-byte aligned"):
        fused_qknorm_rope_cache(**args, q_out=flat[1:1 + q_out.numel()].view(q_out.shape))
    with pytest.raises(TypeError, match="q_out: expected dtype"):
        fused_qknorm_rope_cache(**args, q_out=q_out.half())
    bad = dict(args, slot_mapping=args["slot_mapping"].clone())
    bad["slot_mapping"][3] = 1 << 40
    with pytest.raises(ValueError, match="slot_mapping: entry 3"):
        fused_qknorm_rope_cache(**bad, q_out=q_out, checked=True)


def test_cuda_graph_capture_with_padding():
    v = _seed_variant()
    static = make_inputs(v, 32, 8, 2, slots="decode", pad=6, device="cuda", seed=4)
    q_out = static["qkv"].new_empty((32, 8, v.head_dim))
    iq_out = static["qkv"].new_empty((32, 2, v.head_dim))
    fused_qknorm_rope_cache(**static, q_out=q_out, index_q_out=iq_out)  # warm (build, load)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_qknorm_rope_cache(**static, q_out=q_out, index_q_out=iq_out)
    for seed in (5, 6):
        fresh = make_inputs(v, 32, 8, 2, slots="decode", pad=6, device="cuda", seed=seed)
        for key in ("qkv", "positions", "slot_mapping", "index_slot_mapping"):
            static[key].copy_(fresh[key])
        expected = _clone(static)
        q_ref, iq_ref = fused_qknorm_rope_cache(**expected)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(q_out, q_ref) and torch.equal(iq_out, iq_ref)
        for key in ("k_cache", "v_cache", "index_cache"):
            assert torch.equal(static[key].view(torch.uint8), expected[key].view(torch.uint8)), key


def test_checked_mode_raises_before_writing():
    v = _seed_variant()
    args = make_inputs(v, 8, 8, 2, device="cuda", seed=7)
    args["slot_mapping"][3] = args["k_cache"].shape[0] * 16  # one past the end
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=r"slot_mapping: entry 3 is slot"):
        fused_qknorm_rope_cache(**args, checked=True)
    assert torch.equal(before.view(torch.uint8), args["k_cache"].view(torch.uint8))


def test_out_of_range_slots_and_positions_are_guarded():
    """Unchecked mode: bad slots/positions write nothing out of bounds (and nothing at all)."""
    v = _seed_variant()
    args = make_inputs(v, 16, 8, 2, device="cuda", seed=8)
    cap = args["k_cache"].shape[0] * 16
    args["slot_mapping"][0] = cap + 5
    args["positions"][1] = args["cos_sin_cache"].shape[0] + 3
    stats = check_against_reference(args, fused_qknorm_rope_cache)
    assert stats["q_out"]["addressed"] == 16 * 8 * v.head_dim  # the bad position's row: zeros


# Run apart (a trap leaves the process's CUDA context unusable): one call as made, then
# the same call with one cache descriptor's memory taken away; no token has a slot, so
# only the kernel's check of its arguments (Fused::check_args) can stop the second.
_BROKEN_DESCRIPTOR = """
import torch
from kvforge.runtime.api import launch_with
from kvforge.runtime.registry import spec
from kvforge.runtime.testing import make_inputs, with_outputs
from kvforge.runtime.tuning import Launch
v = next(v for v in spec().variants if v.uri == {uri!r})
args = make_inputs(v, 4, 8, 2, slots="decode", pad=4, device="cuda", seed=1)
call = launch_with(Launch(1, 2, 0), **with_outputs(args))
call()
torch.cuda.synchronize()
print("intact call ran", flush=True)
getattr(call.args[1], {cache!r}).data = None
call()
torch.cuda.synchronize()
print("broken call ran", flush=True)
"""


@pytest.mark.parametrize("kv_scale, index_dtype, cache", [("none", "model", "k_cache"),
                                                          ("per_token_head", "fp8", "v_scale_cache")])
def test_a_cache_descriptor_with_slots_but_no_memory_traps(kv_scale, index_dtype, cache):
    """The kernel reads its cache descriptors before its wait, in a check that a cache
    with slots has memory: such a call fails, even one that writes no cache."""
    v = _seed_variant(kv_scale=kv_scale, index_dtype=index_dtype)
    proc = subprocess.run([sys.executable, "-c", _BROKEN_DESCRIPTOR.format(uri=v.uri, cache=cache)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert "intact call ran" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode != 0 and "broken call ran" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "CUDA error" in proc.stderr, proc.stderr[-3000:]


def _bad_positions(args, tokens):
    """Out-of-range positions (SPEC §1) on tokens spread over the call, inside prefill runs
    (so a V run of a SHUFFLE page has a hole), at both ends of the range and far past it."""
    max_pos = args["cos_sin_cache"].shape[0]
    bad = [0, 5, tokens // 2, tokens // 2 + 1, tokens - 1]
    for t, pos in zip(bad, (-1, max_pos, -(2 ** 40), max_pos + 7, 2 ** 40)):
        args["positions"][t] = pos
    return bad


@pytest.mark.parametrize("k_out", [False, True], ids=["", "k_out"])
@pytest.mark.parametrize("launch", [None, "every"], ids=["tuned", "every-launch"])
@pytest.mark.parametrize("variant", sample_variants(VARIANTS), ids=lambda v: v.uri)
def test_out_of_range_positions_write_zeros_and_no_cache(variant, launch, k_out):
    """A token whose position has no cos/sin row writes zeros to its q_out and index_q_out
    rows (and k_out and index_k_out: given, the call runs kernels of their own) and nothing
    into any cache, V included; its neighbours are written as usual. Outputs and caches
    are poisoned first (check_against_reference), so a row left alone or a cache element
    written shows."""
    tokens = V_LOOP_MIN_TOKENS + 37
    niq = 0 if variant.index_mode is IndexMode.NONE else 2
    args = make_inputs(variant, tokens, 8, niq, slots="prefill", pad=3, device="cuda",
                       seed=zlib.crc32(variant.uri.encode()))
    rows = {}
    if k_out:
        rows["k_out"] = args["qkv"].new_empty(tokens, variant.num_kv_heads, variant.head_dim)
        if variant.index_mode is IndexMode.FULL:
            rows["index_k_out"] = args["qkv"].new_empty(tokens, variant.head_dim)
        args.update(rows)
    bad = _bad_positions(args, tokens)
    check = ReferenceCheck(args, ref_device="cuda")
    runs = [lambda **a: fused_qknorm_rope_cache(**a)] if launch is None else [
        lambda launch=la, **a: launch_with(launch, **a)() for la in launches(variant)]
    for run in runs:
        check(run)
    got = with_outputs(args)
    fused_qknorm_rope_cache(**got)
    for name in ("q_out", "index_q_out" if niq else None, *rows):
        if name:
            assert not got[name][bad].view(torch.uint8).any(), name


def test_vllm_nhd_views_unbound_from_one_allocation():
    v = next(x for x in VARIANTS if x.contract.name == "vllm_nhd" and x.kv_scale.value == "per_head")
    args = make_inputs(v, 300, 16, 2, slots="prefill", pad=7, device="cuda", seed=9)
    both = torch.empty((args["k_cache"].shape[0], 2, *args["k_cache"].shape[1:]),
                       dtype=args["k_cache"].dtype, device="cuda")
    args["k_cache"], args["v_cache"] = both.unbind(1)
    check_against_reference(args, fused_qknorm_rope_cache)


def _one_per_v_loop_shape():
    """The first SHUFFLE variant (4 kv heads) of each head_dim, model dtype and KV dtype."""
    first = {}
    for v in VARIANTS:
        if v.axes()["contract"] == "vllm_shuffle16" and v.num_kv_heads == 4:
            first.setdefault((v.head_dim, v.dtype, v.kv_scale), v)
    return list(first.values())


@pytest.mark.parametrize("variant", _one_per_v_loop_shape(), ids=lambda v: v.uri)
def test_shuffle_v_loop_groups_write_several_items(variant):
    """In a long prefill each group of the V loop writes one item after another (bf16 and
    fp16 runs through the same shared-memory stage): here at least three per group."""
    niq = 0 if variant.index_mode is IndexMode.NONE else 1
    args = make_inputs(variant, v_loop_tokens(variant, 3), 1, niq, slots="prefill", device="cuda", seed=11)
    check_against_reference(args, lambda **a: launch_with(Launch(0, 0, V_LOOP_ON), **a)(),
                            ref_device="cuda")  # 51-203k tokens


@pytest.mark.parametrize("v_loop", [V_LOOP_OFF, V_LOOP_ON], ids=["main-loop", "v-loop"])
@pytest.mark.parametrize("kv_scale", ["none", "per_tensor"])
def test_shuffle_v_groups_that_are_almost_runs(kv_scale, v_loop):
    """SHUFFLE's V loop stores a group as vectors when its slots are one aligned run; a
    group whose middle is out of order, or whose run starts off a multiple of its length,
    must still land value by value. The same slots with V in the main loop, as a tuned
    table may choose for such a call."""
    v = _seed_variant(kv_scale=kv_scale, fp8="e4m3fn") if kv_scale != "none" else _seed_variant()
    tg = 8  # the V loop's group: a whole vector of bf16 tokens, half of one of FP8
    args = make_inputs(v, 64, 8, 2, slots="prefill", device="cuda", seed=10)  # 8 groups
    sm = args["slot_mapping"]
    sm[1], sm[2] = sm[2].clone(), sm[1].clone()            # group 0: middle swapped
    sm[tg + 3] = -1                                         # group 1: a padded token inside
    sm[2 * tg:3 * tg] = sm[2 * tg:3 * tg].flip(0)           # group 2: reversed (not taken)
    ps, pages = v.page_size("v"), args["v_cache"].shape[access(v, "v").runtime_dim]
    free = sorted(set(range(pages)) - set((sm[sm >= 0] // ps).tolist()))
    sm[3 * tg:4 * tg] = free[0] * ps + 1 + torch.arange(tg, device=sm.device)  # group 3: a run from an odd slot
    check_against_reference(args, lambda **a: launch_with(Launch(0, 0, v_loop), **a)())
