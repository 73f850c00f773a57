"""Fast self-tests of the loop oracle in spec_loop.py (no GPU, no project code)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from spec_loop import rmsnorm, spec_forward, to_dtype  # noqa: E402

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def _call(qkv, cs, nq=1, nkv=1, niq=1, D=8, R=4, slots=None, islots=None, positions=None,
          w=None, ik_w=None, **kw):
    T = qkv.shape[0]
    w = torch.zeros(D, dtype=qkv.dtype) if w is None else w
    slots = torch.arange(T) if slots is None else slots
    return spec_forward(
        qkv=qkv, positions=torch.zeros(T, dtype=torch.int64) if positions is None else positions,
        cos_sin_cache=cs, slot_mapping=slots,
        index_slot_mapping=slots if islots is None else islots,
        q_w=w, k_w=w, iq_w=w, ik_w=w if ik_w is None else ik_w,
        num_heads=nq, num_kv_heads=nkv, num_index_heads=niq, rotary_dim=R, **kw)


def _identity_cs(R, dtype=torch.float32):
    return torch.cat([torch.ones(1, R // 2), torch.zeros(1, R // 2)], 1).to(dtype)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_identity_rope_gives_normalized_q(dt):
    # cos=1, sin=0: y_i = n_i*1 - n_{i+h}*0 = n_i exactly, so q_out must be round(norm(q)).
    torch.manual_seed(0)
    nq, nkv, niq, D, R = 3, 2, 2, 16, 10
    qkv = torch.randn(4, (nq + 2 * nkv + niq + 1) * D).to(dt)
    w = (0.1 * torch.randn(D)).to(dt)
    out = _call(qkv, _identity_cs(R, dt), nq, nkv, niq, D, R, w=w, eps=1e-6)
    q = qkv[:, :nq * D].float().view(4, nq, D)
    for t in range(4):
        for h in range(nq):
            exp = to_dtype(rmsnorm(q[t, h].tolist(), w.float().tolist(), 1e-6, "gemma"), dt)
            assert torch.equal(out["q_out"][t, h], exp)
    # ... and that normalization agrees with an fp64 formula to within an ulp of dt.
    ref = q.double() * torch.rsqrt(q.double().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    torch.testing.assert_close(out["q_out"].double(), ref, rtol=2 * torch.finfo(dt).eps, atol=1e-6)
    assert out["index_q_out"].shape == (4, niq, D) and out["index_q_out"].dtype == dt


def test_hand_computed_rope_pairing():
    # D=8, R=4, h=2: pairs (0,2), (1,3); dims 4..7 pass through.  sum(x^2)=8 -> mean 1,
    # eps=0, w=0 -> norm is the identity, so the numbers below are exact.
    x = [2.0, 1.0, -1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    k = [0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0]  # sum 8 too
    v = [3.0, -5.0, 7.0, 0.5, 0.0, 0.0, 1.0, 2.0]
    qkv = torch.tensor([x + k + v], dtype=torch.bfloat16)
    # Row 0 is junk: position 1 must be the one used.  Row = [cos0 cos1 | sin0 sin1].
    cs = torch.tensor([[9.0, 9.0, 9.0, 9.0], [0.5, 0.25, 0.75, -0.5]])
    out = _call(qkv, cs, positions=torch.tensor([1]), eps=0.0, index_mode="none",
                slots=torch.tensor([5]))
    # y0 = 2*.5 - (-1)*.75 = 1.75; y2 = -1*.5 + 2*.75 = 1; y1 = 1*.25 - 0*(-.5) = .25;
    # y3 = 0*.25 + 1*(-.5) = -.5
    assert out["q_out"][0, 0].tolist() == [1.75, 0.25, 1.0, -0.5, 1.0, 1.0, 0.0, 0.0]
    slot, kk = out["k"][0]
    assert slot == 5 and kk.tolist() == [[0.0, 0.5, 0.0, -1.0, 0.0, 0.0, 2.0, 0.0]]
    assert out["v"][0][1].tolist() == [v]  # V raw
    assert out["index_q_out"] is None and out["index"] == {}


def test_padded_and_missing_slots():
    torch.manual_seed(1)
    D, T = 8, 5
    qkv = torch.randn(T, 5 * D).to(torch.bfloat16)  # nq=nkv=niq=1
    slots = torch.tensor([3, -1, 7])          # tokens 3, 4 beyond len(slot_mapping)
    islots = torch.tensor([-1, 2, 4, 6])      # own index mapping, token 4 beyond it
    out = _call(qkv, _identity_cs(4), slots=slots, islots=islots, eps=1e-6)
    assert out["q_out"].shape == (T, 1, D) and out["index_q_out"].shape == (T, 1, D)
    assert {t: s for t, (s, _) in out["k"].items()} == {0: 3, 2: 7}
    assert {t: s for t, (s, _) in out["v"].items()} == {0: 3, 2: 7}
    assert {t: s for t, (s, _) in out["index"].items()} == {1: 2, 2: 4, 3: 6}
    # skip: rows still carry index parts, nothing index-related is produced
    skip = _call(qkv, _identity_cs(4), slots=slots, eps=1e-6, index_mode="skip")
    assert skip["index_q_out"] is None and skip["index"] == {}
    assert torch.equal(skip["q_out"], out["q_out"])


def _codes(t):
    return t.view(torch.uint8).flatten().tolist()


@pytest.mark.parametrize("fp8,mx,sat_big,nan_pos,nan_neg", [
    (FN, 448.0, 0x7E, 0x7F, 0xFF),
    (FNUZ, 240.0, 0x7F, 0x80, 0x80),
])
def test_fp8_saturate_vs_passthrough(fp8, mx, sat_big, nan_pos, nan_neg):
    D = 8
    # V is raw, so its values reach the quantizer unchanged (times 1/scale).
    v = [1000.0, -1000.0, 460.0, 244.0, 250.0, 1.0, -0.5, 0.0]
    q = [1.0] + [0.0] * 7
    qkv = torch.tensor([q + q + v + q + q], dtype=torch.float16)
    cs = _identity_cs(4)
    ik_w = torch.full((D,), 99.0, dtype=torch.float16)  # index_k = 1*sqrt(8)*100 = 282.8
    kw = dict(eps=0.0, kv_fp8=fp8, index_fp8=fp8, ik_w=ik_w)
    sat = _call(qkv, cs, saturate=True, **kw)
    pas = _call(qkv, cs, saturate=False, **kw)
    assert sat["v"][0][1].dtype == fp8
    sv = sat["v"][0][1].float().flatten().tolist()
    assert sv[:2] == [mx, -mx] and sv[5:] == [1.0, -0.5, 0.0]
    assert _codes(sat["v"][0][1])[0] == sat_big
    pc = _codes(pas["v"][0][1])
    assert pc[:2] == [nan_pos, nan_neg]
    if fp8 == FN:   # 460 < 464 rounds to 448; 244 -> 240, 250 -> 256
        assert pas["v"][0][1].float().flatten().tolist()[2:5] == [448.0, 240.0, 256.0]
    else:           # 460, 250 >= 248 -> NaN; 244 -> 240
        assert pc[2] == 0x80 and pc[4] == 0x80 and pas["v"][0][1].float()[0, 3] == 240.0
    # Index FP8 always saturates to its own format's max (240 on fnuz, never 448).
    for o in (sat, pas):
        ik = o["index"][0][1].float()
        assert ik[0] == (288.0 if fp8 == FN else 240.0)  # 282.8 -> 288 in e4m3fn
    # Scales: stored = cast(v * (1/scale)); per-head list of length nkv=1 and per tensor.
    scaled = _call(qkv, cs, saturate=True, v_scale=[4.0], k_scale=[0.5], **kw)
    # 1000/4=250: e4m3fn -> 256, e4m3fnuz clamps to 240; 460/4=115 -> 112; 244/4=61 -> 60
    big = 256.0 if fp8 == FN else 240.0
    assert scaled["v"][0][1].float().flatten().tolist()[:4] == [big, -big, 112.0, 60.0]
    # K = sqrt(8) rounded to fp16 (2.828125), times 1/0.5 = 5.65625 -> 5.5 in e4m3
    assert scaled["k"][0][1].float()[0, 0] == 5.5
