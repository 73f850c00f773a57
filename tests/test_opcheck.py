"""The registered op, `torch.ops.kvforge.fused_qknorm_rope_cache`, as torch's tools see it.

`torch.library.opcheck` for a variant of every contract and index mode (schema: what the
op mutates and aliases, checked by running it; the fake implementation against the real
one; registration with autograd; AOT dispatch with dynamic shapes), the schema's mutation
annotations read directly, `torch.compile(fullgraph=True, dynamic=True)` over changing
token counts without a recompile per count, K and V passed as views of one buffer under
Inductor, and (GPU) CUDA graphs captured at several token counts. On the CPU the op runs
the reference; the same tests run on CUDA with `pytest -m gpu`.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from kvforge.codegen.model import IndexMode
from kvforge.codegen.signature import ARGS, CALL_NAMES, Kind
from kvforge.runtime import fused_qknorm_rope_cache
from kvforge.runtime.registry import spec
from kvforge.runtime.testing import MUTABLE, make_inputs, with_outputs

SPEC = spec()
OP = torch.ops.kvforge.fused_qknorm_rope_cache.default
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _one_per(key, pick) -> list:
    chosen = {}
    for v in SPEC.variants:
        if pick(v):
            chosen.setdefault(key(v), v)
    return [chosen[k] for k in sorted(chosen)]


# A model-dtype variant of every contract and index mode, and an FP8 one of every contract.
MODEL = _one_per(lambda v: (v.contract.name, v.index_mode.value), lambda v: not v.kv_fp8 and not v.index_fp8)
FP8 = _one_per(lambda v: v.contract.name, lambda v: v.kv_fp8)


def _heads(v) -> tuple[int, int]:
    return 4, (0 if v.index_mode is IndexMode.NONE else 2)


def op_args(v, tokens: int, device: str, seed: int = 0) -> tuple:
    """The op's positional arguments (outputs passed, checked=False)."""
    args = with_outputs(make_inputs(v, tokens, *_heads(v), device=device, seed=seed))
    return tuple(args.get(name) for name in CALL_NAMES) + (False,)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


def test_the_schema_marks_exactly_the_outputs_and_caches_written():
    """Each cache and output is `Tensor(a!)` (written in place, its own alias set); every
    other tensor is read-only; nothing is returned, so no output aliases an input."""
    schema = OP._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == set(MUTABLE)
    assert all(a.alias_info is None for a in schema.arguments if a.name not in MUTABLE)
    sets = [frozenset(a.alias_info.before_set) for a in schema.arguments if a.name in MUTABLE]
    assert len(set(sets)) == len(sets)
    assert list(schema.returns) == []
    assert [a.name for a in schema.arguments] == [a.name for a in ARGS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", MODEL, ids=lambda v: v.uri)
def test_opcheck(v, device):
    torch.library.opcheck(OP, op_args(v, 5, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", FP8, ids=lambda v: v.uri)
def test_opcheck_fp8(v, device):
    """torch's schema check compares tensors with allclose, which FP8 does not implement
    (`"mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'`): the other checks here,
    and what the schema check verifies by the bytes in test_the_op_writes_only_what_its_schema_says."""
    torch.library.opcheck(OP, op_args(v, 5, device),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", MODEL + FP8, ids=lambda v: v.uri)
def test_the_op_writes_only_what_its_schema_says(v, device):
    argv = op_args(v, 7, device, seed=1)
    written = {a.name for a in OP._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    gen = torch.Generator().manual_seed(2)
    for name, x in zip(CALL_NAMES, argv):  # poison what may be written, so a write shows
        if name in written and isinstance(x, torch.Tensor):
            raw = torch.randint(0, 256, (x.untyped_storage().nbytes(),), generator=gen, dtype=torch.uint8)
            torch.empty(0, dtype=torch.uint8, device=x.device).set_(x.untyped_storage()).copy_(raw.to(x.device))
    before = {name: _bytes(x) for name, x in zip(CALL_NAMES, argv) if isinstance(x, torch.Tensor)}
    OP(*argv)
    after = {name: _bytes(x) for name, x in zip(CALL_NAMES, argv) if isinstance(x, torch.Tensor)}
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed <= written, f"written but not marked mutable: {changed - written}"
    assert "q_out" in changed


# ---- torch.compile over changing token counts -------------------------------------------------
CACHES = tuple(a.name for a in ARGS if a.kind is Kind.CACHE)
PER_CALL = ("qkv", "positions", "slot_mapping", "index_slot_mapping")
COMPILED = _one_per(lambda v: v.contract.name, lambda v: v.index_mode is IndexMode.FULL)
TOKENS = (5, 9, 17, 33)


def _backend(device: str) -> str:
    # CPU: AOT autograd's functionalization of the in-place writes (what Inductor consumes)
    # without compiling C++; the GPU runs Inductor itself.
    return "aot_eager" if device == "cpu" else "inductor"


def _same(a: dict, b: dict, keys) -> None:
    for key in keys:
        if a.get(key) is not None:
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", COMPILED, ids=lambda v: v.uri)
def test_compiled_over_changing_token_counts_without_recompiling(v, device):
    """One graph serves every token count (dynamic=True): the fake implementation gives
    no shapes to specialize on and the caches (allocated once, as engines do) keep theirs."""
    nq, niq = _heads(v)
    caches = {k: t for k, t in make_inputs(v, max(TOKENS), nq, niq, device=device).items() if k in CACHES}
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(_backend(device))
    frames = None
    for tokens in TOKENS:
        args = make_inputs(v, tokens, nq, niq, device=device, seed=tokens)
        static = {k: x for k, x in args.items() if k not in PER_CALL + CACHES}

        def step(qkv, positions, slot_mapping, index_slot_mapping, caches):
            q, iq = fused_qknorm_rope_cache(qkv=qkv, positions=positions, slot_mapping=slot_mapping,
                                            index_slot_mapping=index_slot_mapping, **caches, **static)
            return q, iq

        compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
        eager_caches = {k: t.clone() for k, t in caches.items()}
        per_call = [args.get(k) for k in PER_CALL]
        q_c, iq_c = compiled(*per_call, caches)
        q_e, iq_e = step(*per_call, eager_caches)
        _same({"q": q_c, "iq": iq_c, **caches}, {"q": q_e, "iq": iq_e, **eager_caches}, ("q", "iq", *caches))
        if frames is None:
            frames = counter.frame_count
        assert counter.frame_count == frames, f"recompiled at {tokens} tokens"
    assert frames >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_k_and_v_as_views_of_one_buffer_compile_with_inductor(device):
    """Engines allocate K and V as one [pages, 2, ...] buffer and pass its two halves. Under
    dynamic shapes V's offset is symbolic, and Inductor without a lowering for
    aten.sym_storage_offset (pytorch/pytorch#198068) passed V at offset 0: V written over K.
    kvforge registers that lowering where it is missing (runtime/api.py)."""
    from torch._inductor import config

    v = next(v for v in MODEL if v.contract.name == "vllm_nhd")
    nq, niq = _heads(v)
    k = make_inputs(v, 16, nq, niq, device=device)["k_cache"]
    kv = torch.zeros((k.shape[0], 2, *k.shape[1:]), dtype=k.dtype, device=device)
    torch._dynamo.reset()
    with config.patch(force_disable_caches=True):  # a cached graph would skip the lowering
        for tokens in (3, 7):
            args = make_inputs(v, tokens, nq, niq, device=device, seed=tokens)
            static = {x: t for x, t in args.items() if x not in (*PER_CALL, "k_cache", "v_cache")}

            def step(qkv, positions, slot_mapping, index_slot_mapping, kv):
                return fused_qknorm_rope_cache(qkv=qkv, positions=positions, slot_mapping=slot_mapping,
                                               index_slot_mapping=index_slot_mapping, k_cache=kv[:, 0],
                                               v_cache=kv[:, 1], **static)

            compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=True)
            mine, eager = kv.clone(), kv.clone()
            per_call = [args.get(x) for x in PER_CALL]
            q_c, _ = compiled(*per_call, mine)
            q_e, _ = step(*per_call, eager)
            assert torch.equal(q_c, q_e)
            assert torch.equal(mine[:, 0].view(torch.uint8), eager[:, 0].view(torch.uint8)), "K"
            assert torch.equal(mine[:, 1].view(torch.uint8), eager[:, 1].view(torch.uint8)), "V"


# ---- CUDA graphs: one captured per token count ------------------------------------------------
@pytest.mark.gpu
def test_cuda_graphs_captured_at_several_token_counts():
    """As engines capture a graph per batch size over views of static buffers: each graph
    replays its own token count (the launch it recorded, the tensors' addresses), whatever
    order they replay in, on fresh inputs copied into the static buffers."""
    v = next(v for v in MODEL if v.contract.name == "vllm_shuffle16" and v.index_mode is IndexMode.FULL)
    nq, niq = 8, 2
    tmax = 64
    static = with_outputs(make_inputs(v, tmax, nq, niq, slots="decode", device="cuda", seed=1))

    def call(tokens: int, state: dict) -> None:
        fused_qknorm_rope_cache(**{**state, **{k: state[k][:tokens] for k in (*PER_CALL, "q_out", "index_q_out")}})

    graphs = {}
    for tokens in (1, 7, 33, tmax):
        call(tokens, static)  # warm: build, load, bind the signature
        torch.cuda.synchronize()
        graphs[tokens] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[tokens]):
            call(tokens, static)
    for tokens in (33, 1, tmax, 7):
        fresh = make_inputs(v, tmax, nq, niq, slots="decode", device="cuda", seed=100 + tokens)
        for key in PER_CALL:
            static[key].copy_(fresh[key])
        expected = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in static.items()}
        call(tokens, expected)  # eager, on copies of the same state
        graphs[tokens].replay()
        torch.cuda.synchronize()
        _same(static, expected, ("k_cache", "v_cache", "index_cache"))
        for key in ("q_out", "index_q_out"):
            assert torch.equal(static[key][:tokens], expected[key][:tokens]), (tokens, key)
