"""The public op on CPU: validation (SPEC §7), signature derivation, dispatch."""
import inspect

import pytest
import torch

from kvforge.codegen.signature import CALL_ARGS, CALL_NAMES, Kind
from kvforge.runtime import fused_qknorm_rope_cache, minimax_m3_qknorm_rope_cache_shuffle_insert
from kvforge.runtime.registry import spec
from kvforge.runtime.testing import MUTABLE, make_inputs, with_outputs
from kvforge.runtime.validate import check

SPEC = spec()


def variant(**axes):
    return next(v for v in SPEC.variants if all(v.axes().get(k) == str(x) for k, x in axes.items()))


SEED = variant(contract="vllm_shuffle16", num_kv_heads=4, index_dtype="model", kv_scale="none",
               rotary_dim=64, cos_sin="bf16", norm="gemma", dtype="bf16")
SEED_FP8 = variant(contract="vllm_shuffle16", num_kv_heads=4, index_dtype="fp8",
                   kv_scale="per_tensor", fp8="e4m3fnuz")
SGLANG = variant(contract="sglang_nhd", num_kv_heads=4, kv_scale="unit", index_dtype="model",
                 cos_sin="fp32")


def seed_args(v=SEED, tokens=6, **kw):
    return with_outputs(make_inputs(v, tokens, 4, 2, seed=11, **kw))


def argv_of(args):
    """The op's argument vector of a call's keyword arguments (the table's defaults where absent)."""
    return tuple(args.get(a.name, a.default) for a in CALL_ARGS)


def snapshot(args):
    return {k: args[k].clone() for k in MUTABLE if isinstance(args.get(k), torch.Tensor)}


def assert_untouched(args, snap):
    for k, before in snap.items():
        assert torch.equal(args[k].view(torch.uint8), before.view(torch.uint8)), k


def bad(args, exc, message, **changes):
    """The call with `changes` raises exc(message) and writes nothing."""
    args = dict(args, **changes)
    snap = snapshot(args)
    with pytest.raises(exc) as info:
        fused_qknorm_rope_cache(**args)
    assert str(info.value) == message
    assert_untouched(args, snap)


def test_runs_on_cpu_and_returns_outputs():
    args = make_inputs(SEED, 5, 4, 2, seed=1)
    q, iq = fused_qknorm_rope_cache(**args)
    assert q.shape == (5, 4, 128) and q.dtype == torch.bfloat16
    assert iq.shape == (5, 2, 128) and iq.dtype == torch.bfloat16
    skip = variant(contract="vllm_shuffle16", index_mode="skip", num_kv_heads=4, kv_scale="none")
    q, iq = fused_qknorm_rope_cache(**make_inputs(skip, 5, 4, 2, seed=1))
    assert iq is None


def test_signature_is_read_from_the_tensors():
    args = seed_args(SEED_FP8)
    assert args["k_cache"].dtype == torch.float8_e4m3fnuz
    v, _ = check(**{a.name: args.get(a.name) for a in CALL_ARGS})
    assert v == SEED_FP8


A = seed_args()


@pytest.mark.parametrize("changes,exc,message", [
    (dict(qkv=A["qkv"].float()), TypeError, "qkv: expected dtype bfloat16, float16, got float32"),
    (dict(qkv=A["qkv"][:, None]), ValueError, "qkv: expected a 2-D tensor [num_tokens, row], got shape (6, 1, 1920)"),
    (dict(qkv=torch.empty(1920, 6, dtype=torch.bfloat16).t()), ValueError,
     "qkv: expected rows of contiguous elements whose row stride is a multiple of 8, got strides (1, 6)"),
    (dict(num_heads=5), ValueError, "qkv: expected rows of 2048 elements (num_heads=5 + 2*num_kv_heads=4 "
     "+ num_index_heads=2 + 1 index_k head = 16 heads of head_dim 128, index_mode full), got rows of 1920"),
    (dict(rotary_dim=63), ValueError, "rotary_dim: expected an even number in [2, head_dim=128], got 63"),
    (dict(cos_sin_cache=A["cos_sin_cache"][:0]), ValueError,
     "cos_sin_cache: expected at least one row (position), got shape (0, 64)"),
    (dict(rotary_dim=130), ValueError, "rotary_dim: expected an even number in [2, head_dim=128], got 130"),
    (dict(positions=A["positions"][:5]), ValueError, "positions: expected 6 entries (one per qkv row), got 5"),
    (dict(positions=A["positions"].int()), TypeError, "positions: expected dtype int64, got int32"),
    (dict(positions=A["positions"].to("meta")), ValueError,
     "positions: expected a tensor on cpu (where qkv is), got meta"),
    (dict(slot_mapping=torch.zeros(7, dtype=torch.int64)), ValueError,
     "slot_mapping: expected at most num_tokens=6 entries, got 7"),
    (dict(cos_sin_cache=A["cos_sin_cache"][:, :32]), ValueError,
     "cos_sin_cache: expected shape [max_pos, rotary_dim=64], got (4096, 32)"),
    (dict(q_norm_weight=A["q_norm_weight"][:64]), ValueError,  # k_norm_weight and the row agree on 128
     "q_norm_weight: expected shape (128,) (head_dim, the size of k_norm_weight, whose heads fill the qkv row), "
     "got (64,)"),
    (dict(k_norm_weight=A["k_norm_weight"][:64]), ValueError,
     "k_norm_weight: expected shape (128,) (head_dim, the size of q_norm_weight), got (64,)"),
    (dict(k_norm_weight=A["k_norm_weight"].half()), TypeError,
     "k_norm_weight: expected dtype bfloat16 (the dtype of qkv), got float16"),
    (dict(k_cache=A["k_cache"][:, :, :, :, :4]), ValueError,
     "k_cache: expected shape [pages, 4, 16, 16, 8] for contract vllm_shuffle16 with this signature, "
     "got (4, 4, 16, 16, 4)"),
    (dict(v_cache=A["v_cache"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "v_cache: expected stride 2048 in dimension 1 (contiguous, as contract vllm_shuffle16 lays it out), got "
     "strides (8192, 1024, 4096, 8, 1)"),
    (dict(v_cache=A["v_cache"].half()), TypeError,
     "v_cache: expected dtype bfloat16 (the dtype of k_cache), got float16"),
    (dict(index_cache=None), ValueError, "index_cache: expected a tensor (required with index_mode 'full'), got None"),
    (dict(index_slot_mapping=None), ValueError,
     "index_slot_mapping: expected a tensor (contract vllm_shuffle16 has its own index slots), got None"),
    (dict(index_mode="sparse"), ValueError, "index_mode: expected one of 'full', 'skip', 'none', got 'sparse'"),
    (dict(contract="trtllm"), ValueError,  # the form, over whatever contracts the variants files hold
     f"contract: expected one of {', '.join(sorted(spec().contracts))}, got 'trtllm'"),
    (dict(kv_cache=A["k_cache"]), ValueError,
     "kv_cache: expected None (contract vllm_shuffle16 keeps K and V in two tensors, k_cache and v_cache), got a "
     "bfloat16 tensor of shape (4, 4, 16, 16, 8)"),
    (dict(norm="layer"), ValueError, "norm: expected one of 'gemma', 'plain', got 'layer'"),
    (dict(q_out=torch.empty(6, 4, 127, dtype=torch.bfloat16)), ValueError,
     "q_out: expected shape (6, 4, 128) or (6, 512), got (6, 4, 127)"),
])
def test_bad_input_is_rejected_before_any_write(changes, exc, message):
    bad(A, exc, message, **changes)


def test_bad_scales_and_signatures():
    f = seed_args(SEED_FP8)
    bad(f, ValueError, "k_scale: expected shape (1,) or () (per tensor) or (4,) (per kv head), got (3,)",
        k_scale=torch.ones(3))
    bad(f, TypeError, "k_scale: expected dtype float32, got float64", k_scale=torch.ones(1, dtype=torch.float64))
    bad(f, ValueError, "v_scale: expected the granularity of k_scale (per_tensor), got unit", v_scale=None)
    bad(f, ValueError, "k_scale: unsupported signature: kv_scale: contract vllm_shuffle16 allows kv_scale none, "
        "per_tensor, per_token_head, not per_head", k_scale=torch.ones(4), v_scale=torch.ones(4))
    bad(f, TypeError, "index_cache: expected dtype float8_e4m3fnuz (the FP8 flavour of k_cache), got float8_e4m3fn",
        index_cache=f["index_cache"].view(torch.float8_e4m3fn), index_q_out=None)
    bad(f, TypeError, "index_q_out: expected dtype float8_e4m3fnuz (the dtype of index_cache), got float8_e4m3fn",
        index_q_out=f["index_q_out"].view(torch.float8_e4m3fn))
    s = seed_args(SGLANG)
    bad(s, ValueError, "k_scale: unsupported signature: kv_scale: contract sglang_nhd allows kv_scale none, unit, "
        "not per_tensor", k_scale=torch.ones(1), v_scale=torch.ones(1))


def test_checked_mode_on_cpu():
    args = seed_args()
    args["positions"][2] = 10 ** 6
    bad(args, ValueError, "positions: entry 2 is 1000000, outside the cos_sin_cache rows [0, 4096)", checked=True)
    args = seed_args()
    args["index_slot_mapping"][4] = 10 ** 6
    bad(args, ValueError, "index_slot_mapping: entry 4 is slot 1000000, but the index cache holds 256 slots",
        checked=True)


def test_aiter_adapter_keeps_aiters_argument_list():
    names = list(inspect.signature(minimax_m3_qknorm_rope_cache_shuffle_insert).parameters)
    assert names == [
        "qkv", "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "num_heads",
        "num_kv_heads", "num_index_heads", "rotary_dim", "eps", "slot_mapping", "k_cache", "v_cache",
        "q_out", "index_q_norm_weight", "index_k_norm_weight", "index_slot_mapping", "index_cache",
        "index_q_out", "kv_cache_dtype", "k_scale", "v_scale", "skip_index_branch"]


def test_aiter_adapter_matches_the_native_call():
    native = seed_args(SEED_FP8)
    mine = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in native.items()}
    fused_qknorm_rope_cache(**native)
    # uint8 caches read as the platform's flavour (e4m3fn off gfx942), so pass typed tensors here.
    minimax_m3_qknorm_rope_cache_shuffle_insert(
        mine["qkv"], mine["q_norm_weight"], mine["k_norm_weight"], mine["cos_sin_cache"],
        mine["positions"], 4, 4, 2, 64, 1e-6, mine["slot_mapping"], mine["k_cache"], mine["v_cache"],
        mine["q_out"].view(6, -1), mine["index_q_norm_weight"], mine["index_k_norm_weight"],
        mine["index_slot_mapping"], mine["index_cache"], mine["index_q_out"],
        kv_cache_dtype="fp8", k_scale=mine["k_scale"], v_scale=mine["v_scale"])
    for k in MUTABLE:
        if native.get(k) is not None:
            assert torch.equal(native[k].view(torch.uint8), mine[k].view(torch.uint8)), k


# ---- any single bad argument: ValueError/TypeError, nothing written (hypothesis) ---------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FUZZ_BASES = [seed_args(SEED, tokens=5), seed_args(SEED_FP8, tokens=5), seed_args(SGLANG, tokens=5)]
_FUZZ_KEYS = sorted({k for b in _FUZZ_BASES for k in b})
_INTS = st.sampled_from([-1, 0, 1, 3, 7, 1000, True, None, 2.0])
_TENSORS = st.sampled_from([None, 3, 2.5, "x", torch.zeros(3), torch.zeros(5, dtype=torch.int64),
                            torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(0),
                            torch.zeros(5, 128, dtype=torch.float8_e4m3fn)])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(range(len(_FUZZ_BASES))), st.sampled_from(_FUZZ_KEYS), st.data())
def test_any_bad_argument_is_rejected_cleanly(base, key, data):
    args = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in _FUZZ_BASES[base].items()}
    kind = next(a.kind for a in CALL_ARGS if a.name == key)
    if kind is Kind.INT:
        args[key] = data.draw(_INTS)
    elif kind is Kind.FLOAT:
        args[key] = data.draw(st.sampled_from([0.0, -1.0, None, "x", float("nan")]))
    elif kind is Kind.CHOICE:
        args[key] = data.draw(st.sampled_from(["", "x", None, 3]))
    else:
        args[key] = data.draw(_TENSORS)
    snap = snapshot(args)
    try:
        fused_qknorm_rope_cache(**args)
    except (ValueError, TypeError):
        assert_untouched(args, snap)


def test_a_bound_call_takes_each_pointer_from_its_own_parameter(monkeypatch):
    """With aliased arguments (v_scale is k_scale, k_norm_weight is q_norm_weight) the
    table must still read each pointer from its own parameter: a later call with the same
    signature may pass separate tensors."""
    import types

    from kvforge.runtime import api, dispatch
    from kvforge.runtime.abi import Args

    args = seed_args(SEED_FP8)
    args.update(v_scale=args["k_scale"], k_norm_weight=args["q_norm_weight"])
    argv = argv_of(args)
    _, t = check(**dict(zip(CALL_NAMES, argv)))
    bound = {}
    monkeypatch.setattr(dispatch, "bind", lambda argv, template, slots, *rest: bound.update(slots))
    api._bind(types.SimpleNamespace(lib=types.SimpleNamespace(launch_address=0, check=None)), Args(), t, argv)
    for name in ("k_scale", "v_scale", "q_norm_weight", "k_norm_weight"):
        assert bound[getattr(Args, name).offset // 8] == CALL_NAMES.index(name), name


def test_the_op_itself_needs_its_outputs_passed():
    """The public function allocates q_out / index_q_out; the op (torch.ops.kvforge, whose
    schema makes index_q_out optional) and validation refuse a missing one, writing nothing."""
    args = seed_args()
    call = dict(args, index_q_out=None)
    snap = snapshot(call)
    required = (r": expected a tensor \(an output the kernel writes; fused_qknorm_rope_cache allocates it when "
                r"not passed\), got None$")
    with pytest.raises(ValueError, match="^index_q_out" + required):
        torch.ops.kvforge.fused_qknorm_rope_cache(*argv_of(call), False)
    assert_untouched(call, snap)
    with pytest.raises(ValueError, match="^q_out" + required):
        check(**{a.name: v for a, v in zip(CALL_ARGS, argv_of(dict(args, q_out=None)))})


def test_a_tensor_without_a_data_pointer_gets_a_validation_error():
    args = dict(seed_args(), positions=seed_args()["positions"].to_sparse())
    with pytest.raises(ValueError, match=r"^positions: "):
        fused_qknorm_rope_cache(**args)
