"""The engines' modes on the GPU, beyond every variant's generic cases (tests/test_gpu.py):
the FP8 query output in place of q_out, K and index_k written to outputs whose rows are
strided views of wider buffers, per-token scales of all-zero heads, and page sizes no
family lists (built on first use). Each against the reference at SPEC §6's bar, every byte
the call does not address (the rows' gaps included) checked unchanged."""
import dataclasses

import pytest
import torch

from kvforge.codegen.layout import access
from kvforge.codegen.model import make_variant
from kvforge.runtime import build, fused_qknorm_rope_cache, toolchain
from kvforge.runtime.registry import source_of, spec
from kvforge.runtime.testing import check_against_reference, make_inputs

pytestmark = pytest.mark.gpu
SPEC = spec()


def _variant(**axes):
    return make_variant(SPEC.contracts, {**SPEC.defaults, **axes})


PER_TOKEN = _variant(contract="vllm_shuffle16", num_kv_heads=4, kv_scale="per_token_head", index_dtype="fp8")
PER_TOKEN_NHD = _variant(contract="aiter_nhd", num_kv_heads=4, kv_scale="per_token_head", index_dtype="fp8",
                         fp8="e4m3fnuz")
Q_FP8 = _variant(contract="vllm_shuffle16", num_kv_heads=1, q_fp8="per_tensor", kv_scale="per_tensor",
                 index_dtype="fp8")
# Sizes the contracts allow that no family lists (rendered and built on first use).
UNLISTED = [_variant(contract="vllm_nhd", num_kv_heads=4, kv_page_size=32, index_page_size=16),
            _variant(contract="aiter_nhd", num_kv_heads=1, kv_page_size=8, index_page_size=8, kv_scale="unit",
                     fp8="e4m3fnuz"),
            _variant(contract="vllm_m3_nhd", num_kv_heads=4, kv_page_size=64, index_page_size=64),
            _variant(contract="aiter_packed_shuffle", num_kv_heads=1, kv_scale="per_tensor", fp8="e4m3fnuz")]


@pytest.fixture(autouse=True, scope="module")
def _built():
    """This module's variants, listed or not, built at once before its first test."""
    vs = {v.uri: v for v in (PER_TOKEN, PER_TOKEN_NHD, Q_FP8, *UNLISTED)}
    build.build_many([build.Job(u, source_of(v)) for u, v in vs.items()], toolchain.default())


@pytest.mark.parametrize("tokens,slots", [(5, "decode"), (700, "prefill")])
def test_the_fp8_query_output_alone(tokens, slots):
    """q_fp8_out without q_out: q is written as FP8 only (the call returns no q_out)."""
    args = dict(make_inputs(Q_FP8, tokens, 16, 1, slots=slots, device="cuda", seed=tokens), q_out=None)
    stats = check_against_reference(args, fused_qknorm_rope_cache)
    assert "q_out" not in stats and stats["q_fp8_out"]["addressed"] == tokens * 16 * 128
    q, _ = fused_qknorm_rope_cache(**args)
    assert q is None


def _rows(t: int, heads: int, d: int, gap: int, dtype) -> torch.Tensor:
    """[t, heads * d] rows of a wider [t, heads * d + gap] buffer (a strided view)."""
    return torch.empty(t, heads * d + gap, dtype=dtype, device="cuda")[:, :heads * d]


@pytest.mark.parametrize("variant", [PER_TOKEN, Q_FP8], ids=lambda v: v.uri)
def test_outputs_in_strided_rows_and_k_index_k_beside_their_caches(variant):
    """Every output as rows of a wider buffer (the gaps must keep their poison), and K and
    index_k also written to k_out and index_k_out in the model dtype."""
    T, nq, D, nkv = 300, 8, variant.head_dim, variant.num_kv_heads
    args = make_inputs(variant, T, nq, 2, slots="prefill", pad=3, device="cuda", seed=4)
    bf16, idx = args["qkv"].dtype, args["index_cache"].dtype
    args.update(q_out=_rows(T, nq, D, 8, bf16), index_q_out=_rows(T, 2, D, 16 // idx.itemsize, idx),
                k_out=_rows(T, nkv, D, 24, bf16), index_k_out=_rows(T, 1, D, 8, bf16))
    if "q_fp8_out" in args:
        args["q_fp8_out"] = _rows(T, nq, D, 16, args["q_fp8_out"].dtype)
    stats = check_against_reference(args, fused_qknorm_rope_cache)
    assert stats["k_out"]["addressed"] == T * nkv * D and stats["index_k_out"]["addressed"] == T * D


@pytest.mark.parametrize("variant", [PER_TOKEN, PER_TOKEN_NHD], ids=lambda v: v.uri)
@pytest.mark.parametrize("tokens", [3, 600])  # the main loop's V, then the V loop's (SHUFFLE)
def test_per_token_scales_of_all_zero_heads(variant, tokens):
    """AITER: a head whose values are all zero has scale 1 and stores zeros (K: normed zeros
    stay zero), beside heads of values; the scale caches' other bytes untouched."""
    args = make_inputs(variant, tokens, 8, 1, slots="prefill", device="cuda", seed=tokens)
    D, nkv = variant.head_dim, variant.num_kv_heads
    qkv = args["qkv"]
    zero_k = slice(8 * D, (8 + 1) * D)                  # token 0's first K head
    zero_v = slice((8 + nkv + 1) * D, (8 + nkv + 2) * D)  # and its second V head
    qkv[0, zero_k] = 0
    qkv[0, zero_v] = 0
    stats = check_against_reference(args, fused_qknorm_rope_cache)
    assert stats["k_scale_cache"]["addressed"] == stats["v_scale_cache"]["addressed"] == tokens * nkv
    slot = int(args["slot_mapping"][0])
    for role, h in (("k_scale", 0), ("v_scale", 1)):
        acc, c = access(variant, role), args[f"{role}_cache"]  # contiguous: offsets index the storage
        off = acc.offset_torch(slot // acc.page_size, slot % acc.page_size, h, 0, c.stride())
        assert float(c.flatten()[int(off)]) == 1.0, role


@pytest.mark.parametrize("variant", UNLISTED, ids=lambda v: v.uri)
@pytest.mark.parametrize("tokens,slots", [(9, "decode"), (333, "prefill")])
def test_page_sizes_no_family_lists(variant, tokens, slots):
    """The page size is read from the tensors; a size the contract allows but no family lists
    is served by a library built on first use."""
    assert variant not in set(SPEC.variants)
    args = make_inputs(variant, tokens, 8, 1, slots=slots, pad=2, device="cuda", seed=tokens,
                       page_stride_pad=1)
    check_against_reference(args, fused_qknorm_rope_cache)


def test_the_shapes_say_the_page_size():
    """One contract, two page sizes: each call's tensors pick their own library."""
    a = make_inputs(UNLISTED[0], 40, 8, 1, device="cuda", seed=1)
    b = make_inputs(dataclasses.replace(UNLISTED[0], kv_page_size=16, index_page_size=64), 40, 8, 1,
                    device="cuda", seed=1)
    for args in (a, b):
        check_against_reference(args, fused_qknorm_rope_cache)
