"""The benchmarks' peer (benchmarks/unfused.py): the unfused torch path the fused op is
timed against. Its numbers mean something only if it writes what the op writes and
torch.compile sees it whole."""
import pytest
import torch

from benchmarks.bench import CONFIGS, TP, find_variant
from benchmarks.unfused import layouts, unfused
from kvforge.runtime.testing import MUTABLE, check_against_reference, make_inputs, with_outputs

CASES = [(name, tp) for name in CONFIGS for tp in (1, 8)]


def _peer(v):
    lay = layouts(v)
    return lambda **a: unfused(v, lay, a, a["q_out"], a.get("index_q_out"))


@pytest.mark.parametrize("name,tp", CASES)
def test_the_peer_writes_what_the_reference_writes(name, tp):
    nq, nkv, niq = TP[tp]
    v = find_variant(CONFIGS[name], nkv)
    args = make_inputs(v, 37, nq, niq, slots="prefill", seed=3)
    # The peer multiplies then adds (the engines' RoPE), so its fp32 K differs from the
    # reference's in the last bits, and a per-token K scale (amax / max) with them: SPEC
    # §6's bar for such an oracle, 2^-20 of the value (8 ulp).
    stats = check_against_reference(args, _peer(v), max_ulp={"k_scale_cache": 8})
    assert {"q_out", "k_cache" if "k_cache" in args else "kv_cache"} <= set(stats)


@pytest.mark.parametrize("name,tp", CASES)
def test_torch_compile_traces_the_peer_in_one_graph(name, tp):
    """fullgraph=True fails on any graph break. With dynamic shapes a break inside the cache
    write once left the benchmark's compiled peers partly eager (a recompile per variant
    until dynamo's limit)."""
    nq, nkv, niq = TP[tp]
    v = find_variant(CONFIGS[name], nkv)
    lay = layouts(v)
    torch._dynamo.reset()
    compiled = torch.compile(unfused, dynamic=True, fullgraph=True, backend="eager")
    for tokens in (24, 40):  # the second call reuses the dynamic-shape graph
        eager = with_outputs(make_inputs(v, tokens, nq, niq, seed=tokens))
        traced = {k: t.clone() if isinstance(t, torch.Tensor) else t for k, t in eager.items()}
        unfused(v, lay, eager, eager["q_out"], eager.get("index_q_out"))
        compiled(v, lay, traced, traced["q_out"], traced.get("index_q_out"))
        for key in MUTABLE:
            if eager.get(key) is not None:
                assert torch.equal(eager[key].view(torch.uint8), traced[key].view(torch.uint8)), key
