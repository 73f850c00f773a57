"""The main loop's lane map (codegen/lanes.py): the one statement of which dims a kernel
lane holds, checked here and emitted into every variant's traits."""
import itertools

import pytest

from kvforge.codegen.lanes import VEC, lane_map
from kvforge.codegen.model import Rope
from kvforge.codegen.render import render_variant
from kvforge.runtime.registry import spec

SHAPES = [(d, r) for d in (16, 32, 64, 128, 256) for r in range(2, d + 1, 2)]


def evaluate(cpp: str, lane: int, i: int) -> int:
    """The emitted `chunk` body ("lane < 4 ? lane + 4 * i : 4 + lane + 2 * i"), evaluated."""
    cond, sep, rest = cpp.partition(" ? ")
    if not sep:
        return eval(cpp, {}, {"lane": lane, "i": i})  # noqa: S307 - our own emitted arithmetic
    then, _, other = rest.partition(" : ")
    return evaluate(then if eval(cond, {}, {"lane": lane}) else other, lane, i)  # noqa: S307


@pytest.mark.parametrize("rope", list(Rope), ids=str)
def test_every_lane_map_holds_each_chunk_once_and_the_emitted_code_is_the_map(rope):
    for d, r in SHAPES:
        m = lane_map(d, r, rope)
        assert sorted(c for pair in m.chunks for c in pair) == list(range(d // VEC)), (d, r)
        assert [tuple(evaluate(m.chunk_cpp(), l, i) for i in range(2)) for l in range(m.lanes)] == list(m.chunks)
        first = m.rotary_lanes  # proven in LaneMap (it raises otherwise); restated here
        for l, i in itertools.product(range(m.lanes), range(2)):
            assert (m.chunks[l][i] * VEC < r) == (l < first[i]), (d, r, l, i)
        # a rope policy reads chunk 1's cos/sin rotary_step dims after chunk 0's
        assert all(c1 * VEC == c0 * VEC + m.rotary_step for c0, c1 in m.chunks[:first[1]]), (d, r)


@pytest.mark.parametrize("d,r", [(128, 64), (128, 48), (256, 128), (64, 16)])
def test_neox_with_aligned_halves_gives_a_rotary_lane_its_partner(d, r):
    """A rotary lane rotates alone: its second chunk is its first's partner, h / 8 on."""
    m = lane_map(d, r, Rope.NEOX)
    assert not m.exchange
    for c0, c1 in m.chunks[:m.rotary_lanes[0]]:
        assert c1 == c0 + r // 2 // VEC and c0 * VEC < r // 2


def test_gptj_pairs_never_leave_a_chunk_and_every_load_instruction_reads_whole_sectors():
    """GPT-J's pairs (2i, 2i + 1) sit in one chunk at every even rotary dim, so no map
    needs an exchange; each chunk slot of a head covers whole 32-byte sectors of a bf16
    row (chunks 2m and 2m + 1 in the same slot); and where the head is long enough for
    an even k >= rotary chunks / 2, only its first k lanes rotate, as NeoX's (the others
    hold pass-through chunks in both slots)."""
    for d, r in SHAPES:
        m = lane_map(d, r, Rope.GPTJ)
        assert not m.exchange
        if m.lanes == 1:
            continue
        slot = {c: i for pair in m.chunks for i, c in enumerate(pair)}
        lane = {c: l for l, pair in enumerate(m.chunks) for c in pair}
        # a sector's two chunks: one slot, lanes 2j and 2j + 1 (so the same sub-lane at two per thread)
        assert all(slot[2 * k] == slot[2 * k + 1] and lane[2 * k] % 2 == 0 and lane[2 * k + 1] == lane[2 * k] + 1
                   for k in range(d // VEC // 2)), (d, r, m.chunks)
        rotary_chunks = -(-r // VEC)
        k = -(-rotary_chunks // 2)
        k += k % 2
        if 2 * k <= d // VEC:
            assert m.chunks[:k] == tuple((i, i + k) for i in range(k)), (d, r)
            assert m.rotary_lanes[0] == min(k, rotary_chunks), (d, r)
        else:
            assert m.chunks == tuple((l, l + m.lanes) for l in range(m.lanes)), (d, r)


@pytest.mark.parametrize("head_dim,rotary_dim,rope,most", [
    (128, 64, Rope.NEOX, 2), (128, 128, Rope.NEOX, 2), (128, 48, Rope.NEOX, 2), (128, 40, Rope.NEOX, 1),
    (128, 36, Rope.NEOX, 1), (64, 32, Rope.NEOX, 2), (32, 16, Rope.NEOX, 2), (16, 16, Rope.NEOX, 1),
    (128, 36, Rope.GPTJ, 2), (128, 40, Rope.GPTJ, 2), (64, 32, Rope.GPTJ, 2), (16, 16, Rope.GPTJ, 1)])
def test_two_lanes_per_thread_only_where_no_partner_is_in_another_lane(head_dim, rotary_dim, rope, most):
    """A thread of two lanes holds lanes LANES / 2 apart, each rotating its own chunks: NeoX
    needs 8-aligned rotary halves (40's halves of 20 are not), GPT-J never exchanges; a head
    needs two lanes or more."""
    assert lane_map(head_dim, rotary_dim, rope).max_sub == most


def test_generated_traits_carry_the_map():
    v = next(v for v in spec().variants if v.rope is Rope.GPTJ and v.head_dim == 128 and v.rotary_dim == 64)
    m = lane_map(128, 64, Rope.GPTJ)
    src = render_variant(v)
    assert f"static KVF_DEVICE int chunk(int lane, int i) {{ return {m.chunk_cpp()}; }}" in src
    assert f"return i ? {m.rotary_lanes[1]} : {m.rotary_lanes[0]};" in src
    assert f"kMaxSub = {m.max_sub};" in src
    assert f"kRotaryStep = {m.rotary_step};" in src and m.rotary_step == 4 * VEC
