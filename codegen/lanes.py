"""The main loop's lane map: which dims of a head each kernel lane holds.

A main-loop lane holds two VEC-dim chunks of one head (32 bytes of the row) and sums
their squares in that order; a head is `lanes` lanes, and a thread may hold `max_sub`
of them (lane l + s * lanes / kSub as its sub-lane s). Where the chunks go is the rotary
style's to say:

- NeoX with VEC-aligned rotary halves: a rotary lane holds a chunk and its partner chunk
  (h / VEC further), so it rotates alone; the pass-through chunks are split in two
  halves so that each load instruction of a head reads whole sectors.
- NeoX otherwise (e.g. rotary dim 36): adjacent chunks, partners exchanged between
  lanes by shuffles (`exchange`), one lane per thread.
- GPT-J: pairs are adjacent dims, inside every chunk, so no lane needs another's. As
  NeoX's: the k first lanes hold chunks i and i + k (each chunk's 4 cos and 4 sin values
  loaded on their own), the pass-through chunks split in two halves, so only those lanes
  rotate and wait for cos/sin. k is ceil(rotary chunks / 2) rounded up to even: runs of
  an odd count of chunks would split sectors between load instructions (a rotary lane
  may then hold a pass-through chunk). A head too short for that (head_dim 16) has lane
  l hold chunks l and l + lanes (every lane rotates: FP8 variants spilled 264 bytes at
  one lane, PERF.md s32). Adjacent chunks in a rotary lane (its cos/sin one run of 8, as
  NeoX's) read half sectors per instruction: 20% slower (PERF.md s30).

This module is the only statement of the map: the reference sums squares in `dims`'
order, and render.py emits `chunk`, `rotary_lanes` and `rotary_step` into each variant's traits
(Traits::Lanes), which the kernel header reads and never restates.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from .layout import VEC
from .model import Rope, Variant


@dataclass(frozen=True)
class Segment:
    """Lanes [first, end): chunk i of lane l is base + slope * l + step * i."""

    first: int
    end: int
    base: int
    slope: int
    step: int


@dataclass(frozen=True)
class LaneMap:
    head_dim: int
    rotary_dim: int
    rope: Rope
    chunks: tuple[tuple[int, int], ...]  # per lane: its two chunks, in summation order
    exchange: bool                       # NeoX partners in other lanes (shuffles)

    @property
    def lanes(self) -> int:
        return len(self.chunks)

    @property
    def max_sub(self) -> int:
        """The most lanes one thread may hold (the tuner tries each count up to it): one
        where partners are exchanged between lanes or a head has a single lane."""
        return 1 if self.exchange or self.lanes < 2 else 2

    @cached_property
    def dims(self) -> tuple[tuple[int, ...], ...]:
        """Each lane's dims in the order it sums their squares."""
        return tuple(tuple(d for c in pair for d in range(c * VEC, c * VEC + VEC)) for pair in self.chunks)

    @cached_property
    def rotary_lanes(self) -> tuple[int, int]:
        """(T0, T1): chunk i of lane l holds rotary dims exactly when l < T_i (every map
        puts the rotary chunks on the first lanes). The kernel asks this of a thread's
        lane; where it is the same for all of a sub-lane's lanes, at compile time."""
        out = tuple(sum(self.chunks[l][i] * VEC < self.rotary_dim for l in range(self.lanes)) for i in range(2))
        for l in range(self.lanes):
            for i in range(2):
                if (self.chunks[l][i] * VEC < self.rotary_dim) != (l < out[i]):
                    raise AssertionError(f"lane map {self.chunks}: rotary chunks not on the first lanes")
        return out

    @cached_property
    def rotary_step(self) -> int:
        """Dims from chunk 0 to chunk 1 of each lane whose chunk 1 holds rotary dims, the
        same for all of them: a rope policy addresses both chunks' cos/sin from chunk 0's
        (one address, compile-time offsets)."""
        steps = {c1 - c0 for c0, c1 in self.chunks[:max(1, self.rotary_lanes[1])]}
        if len(steps) != 1:
            raise AssertionError(f"lane map {self.chunks}: rotary lanes' chunks {sorted(steps)} apart")
        return steps.pop() * VEC

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        """The map as few affine pieces (what the kernel evaluates), proven equal to it."""
        out: list[Segment] = []
        l = 0
        while l < self.lanes:
            c0, c1 = self.chunks[l]
            slope = self.chunks[l + 1][0] - c0 if l + 1 < self.lanes else 1
            seg = Segment(l, l + 1, c0 - slope * l, slope, c1 - c0)
            while seg.end < self.lanes and _at(seg, seg.end) == self.chunks[seg.end]:
                seg = Segment(seg.first, seg.end + 1, seg.base, seg.slope, seg.step)
            out.append(seg)
            l = seg.end
        assert all(_at(next(s for s in out if s.first <= l < s.end), l) == self.chunks[l]
                   for l in range(self.lanes))
        return tuple(out)

    def chunk_cpp(self) -> str:
        """`chunk(lane, i)`'s body expression for the traits (render.py)."""
        def piece(s: Segment) -> str:
            terms = [str(s.base)] if s.base else []
            terms.append("lane" if s.slope == 1 else f"{s.slope} * lane")
            terms.append("i" if s.step == 1 else f"{s.step} * i")
            return " + ".join(terms)
        expr = piece(self.segments[-1])
        for s in reversed(self.segments[:-1]):
            expr = f"lane < {s.end} ? {piece(s)} : {expr}"
        return expr


def _at(s: Segment, lane: int) -> tuple[int, int]:
    c = s.base + s.slope * lane
    return c, c + s.step


@lru_cache(maxsize=None)
def lane_map(head_dim: int, rotary_dim: int, rope: Rope) -> LaneMap:
    chunks, half, lanes = head_dim // VEC, rotary_dim // 2, head_dim // (2 * VEC)
    if rope is Rope.GPTJ:
        k = -(-rotary_dim // (2 * VEC))  # ceil(rotary chunks / 2)
        k += k % 2  # even, so each run of k chunks is whole sectors
        if 2 * k > chunks:
            return LaneMap(head_dim, rotary_dim, rope, tuple((l, l + lanes) for l in range(lanes)), False)
        return LaneMap(head_dim, rotary_dim, rope, _split(chunks, k), False)
    if half % VEC:
        return LaneMap(head_dim, rotary_dim, rope, tuple((2 * l, 2 * l + 1) for l in range(lanes)), True)
    return LaneMap(head_dim, rotary_dim, rope, _split(chunks, half // VEC), False)


def _split(chunks: int, k: int) -> tuple[tuple[int, int], ...]:
    """Lanes i < k hold chunks i and i + k; the rest, the pass-through chunks from 2k on in
    two halves, so each chunk slot of a head is two contiguous runs."""
    rest = (chunks - 2 * k) // 2
    return tuple([(i, i + k) for i in range(k)] + [(2 * k + j, 2 * k + j + rest) for j in range(rest)])


def lane_map_of(v: Variant) -> LaneMap:
    """The variant's lane map."""
    return lane_map(v.head_dim, v.rotary_dim, v.rope)
