"""The torch reference against the independent per-token loop of SPEC §1-§2, with the
caches read back through the contracts' index expressions evaluated independently of the
generator (layout_oracle), for every contract of every variants file."""
import pytest
import torch

from kvforge.codegen.model import Fp8, IndexMode
from kvforge.runtime import fused_qknorm_rope_cache
from kvforge.runtime.reference import FP8_DTYPES, to_fp8
from kvforge.runtime.registry import spec
from kvforge.runtime.testing import make_inputs, with_outputs

from kvforge.runtime.testing import sample_variants
from layout_oracle import read
from spec_loop import spec_forward

SPEC = spec()


def close(a, b, what):
    """Equal but for order-of-summation last bits: ≥ 99% identical, the rest near."""
    a, b = a.float(), b.float()
    same = (a == b) | (a.isnan() & b.isnan())
    assert same.float().mean() >= 0.99, f"{what}: {1 - same.float().mean():.2%} differ"
    fp8 = a.dtype in FP8_DTYPES.values()
    torch.testing.assert_close(a, b, rtol=2 ** -2 if fp8 else 2 ** -6, atol=2 ** -5, msg=what)


# Every third variant, and a sample that meets every contract (a user's included).
CASES = sorted({*SPEC.variants[::3], *sample_variants(SPEC.variants)}, key=lambda v: v.uri)


@pytest.mark.parametrize("variant", CASES, ids=lambda v: v.uri)
def test_reference_matches_the_spec_loop(variant):
    niq = 0 if variant.index_mode is IndexMode.NONE else 2
    args = with_outputs(make_inputs(variant, 11, 4, niq, slots="random", pad=3, seed=5,
                                    cos_sin="random"))
    q, iq = fused_qknorm_rope_cache(**args)
    full = variant.index_mode is IndexMode.FULL
    fp8 = FP8_DTYPES[variant.fp8] if variant.fp8 else None
    loop = spec_forward(
        qkv=args["qkv"], positions=args["positions"], cos_sin_cache=args["cos_sin_cache"],
        slot_mapping=args["slot_mapping"], index_slot_mapping=args.get("index_slot_mapping", args["slot_mapping"]),
        q_w=args["q_norm_weight"], k_w=args["k_norm_weight"], iq_w=args.get("index_q_norm_weight"),
        ik_w=args.get("index_k_norm_weight"), num_heads=4, num_kv_heads=variant.num_kv_heads,
        num_index_heads=niq, rotary_dim=variant.rotary_dim, eps=1e-6, norm=variant.norm.value, rope_style=variant.rope.value,
        index_mode=variant.index_mode.value, kv_fp8=fp8 if variant.kv_fp8 else None,
        k_scale=args["k_scale"].tolist() if "k_scale" in args else None,
        v_scale=args["v_scale"].tolist() if "v_scale" in args else None,
        saturate=variant.contract.saturation.value == "saturate",
        index_fp8=fp8 if variant.index_fp8 else None,
        round_before_quant=variant.contract.round_before_quant, per_token=variant.kv_scale.dynamic,
        q_fp8=fp8 if variant.q_fp8.value != "none" else None,
        q_fp8_scale=float(args["q_fp8_scale"]) if "q_fp8_scale" in args else None)
    D, c, nkv = variant.head_dim, variant.contract.name, variant.num_kv_heads
    if q is not None:
        close(q, loop["q_out"], "q_out")
    if loop["q_fp8_out"] is not None:
        assert torch.equal(args["q_fp8_out"].view(torch.uint8), loop["q_fp8_out"].view(torch.uint8)), "q_fp8_out"
    ps = {role: variant.page_size(role) for role in ("k", "index")}
    assert len(loop["k"]) == 8  # 11 tokens, 3 padded
    k_cache = args.get("k_cache", args.get("kv_cache"))
    v_cache = args.get("v_cache", args.get("kv_cache"))
    for t, (slot, k) in loop["k"].items():
        close(read(c, "k", k_cache, slot, nkv, D, ps["k"]), k, f"k[{t}]")
    for t, (slot, v) in loop["v"].items():
        got = read(c, "v", v_cache, slot, nkv, D, ps["k"]).contiguous()
        assert torch.equal(got.view(torch.uint8), v.view(torch.uint8)), f"v[{t}]"  # V is a copy
    # Per-token scales: V's exact (amax of the input / max: one division); K's amax is of
    # fp32 values the loop's plain sums and products round otherwise (SPEC §6: 2^-20 of it).
    for role in ("k_scale", "v_scale"):
        for t, (slot, scales) in loop[role].items():
            got = read(c, role, args[f"{role}_cache"], slot, nkv, D, ps["k"]).flatten()
            want = torch.tensor(scales)
            if role == "v_scale":
                assert torch.equal(got, want), f"{role}[{t}]"
            else:
                torch.testing.assert_close(got, want, rtol=2 ** -20, atol=0, msg=lambda m: f"{role}[{t}]: {m}")
    if full:
        close(iq, loop["index_q_out"], "index_q_out")
        for t, (slot, ik) in loop["index"].items():
            close(read(c, "index", args["index_cache"], slot, nkv, D, ps["index"])[0], ik, f"index[{t}]")
    else:
        assert iq is None and loop["index"] == {}


def test_fp8_conversion_semantics():
    v = torch.tensor([1000.0, -1000.0, 464.0, 465.0, 250.0, 247.0, 1e-3, -0.0])
    assert to_fp8(v, Fp8.E4M3FN, True).float()[:4].tolist() == [448.0, -448.0, 448.0, 448.0]
    raw = to_fp8(v, Fp8.E4M3FN, False).view(torch.uint8).tolist()
    assert raw[:4] == [0x7F, 0xFF, 0x7E, 0x7F]  # 464 ties to even (448); past it NaN
    nuz = to_fp8(v, Fp8.E4M3FNUZ, False).view(torch.uint8).tolist()
    assert nuz[:6] == [0x80, 0x80, 0x80, 0x80, 0x80, 0x7F]  # 250 -> NaN, 247 -> 240
    assert nuz[7] == 0  # e4m3fnuz has no negative zero
    assert to_fp8(v, Fp8.E4M3FNUZ, True).float()[:2].tolist() == [240.0, -240.0]


def test_vllm_nhd_accepts_k_and_v_unbound_from_one_tensor():
    v = next(x for x in SPEC.variants if x.contract.name == "vllm_nhd" and x.num_kv_heads == 4
             and x.kv_scale.value == "none" and x.index_dtype.value == "model")
    args = make_inputs(v, 9, 4, 2, seed=2)
    both = torch.zeros((args["k_cache"].shape[0], 2, *args["k_cache"].shape[1:]), dtype=torch.bfloat16)
    args["k_cache"], args["v_cache"] = both.unbind(1)
    fused_qknorm_rope_cache(**args)
    sm = args["slot_mapping"]
    x = args["qkv"].view(9, -1, 128)
    assert torch.equal(both[sm // 16, 1, sm % 16], x[:, 8:12])  # V rows landed in the V half


def test_a_reference_check_restores_the_poison_before_each_run():
    """The tuner checks every launch of a count against one ReferenceCheck: a run that wrote
    where nothing is addressed fails, and must not leave its writes to the next run."""
    from kvforge.runtime.api import reference_qknorm_rope_cache
    from kvforge.runtime.testing import ReferenceCheck

    v = SPEC.variants[0]
    check = ReferenceCheck(make_inputs(v, 5, 8, 2, slots="decode", seed=2))
    cache = next(key for key in ("k_cache", "kv_cache") if check.args.get(key) is not None)

    def scribbles(**a):
        reference_qknorm_rope_cache(**a)
        a[cache].view(torch.uint8).zero_()  # a decode of 5 tokens leaves most pages unaddressed

    with pytest.raises(AssertionError, match=f"^{cache}: element .* is not addressed but was written"):
        check(scribbles)
    stats = check(reference_qknorm_rope_cache)
    assert all(s["identical"] == 1.0 for s in stats.values())


def test_a_reference_check_fails_a_kernel_that_writes_its_inputs():
    """Its launches share the inputs: a run that wrote into one fails, and the next run
    gets them back."""
    from kvforge.runtime.api import reference_qknorm_rope_cache
    from kvforge.runtime.testing import ReferenceCheck

    check = ReferenceCheck(make_inputs(SPEC.variants[0], 5, 8, 2, slots="decode", seed=2))

    def writes_positions(**a):
        reference_qknorm_rope_cache(**a)
        a["positions"][0] += 1

    with pytest.raises(AssertionError, match="^positions: the kernel wrote into this input$"):
        check(writes_positions)
    assert all(s["identical"] == 1.0 for s in check(reference_qknorm_rope_cache).values())
