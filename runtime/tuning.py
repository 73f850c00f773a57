"""Tuned launch choices: the main loop's pipeline depth, token tile and head lanes per
thread, where a transposed V is written, and how many groups a K/V head with per-token
scales has, per variant and token range.

Which launch is fastest depends on the shape: a deeper pipeline (cos/sin loaded a token
ahead) hides more memory latency on long runs of tokens but costs registers and a longer
start on short ones; two or four tokens per tile make a head's stores of them one
instruction (whole sectors for SHUFFLE's K) and, at four, keep a warp to one role, but leave
lanes idle on a call of fewer tokens and spread fewer tiles over the SMs; two head lanes per
thread spend a thread's per-token work (addresses, position, reciprocal, loop) on twice the
bytes but keep half the threads in flight; SHUFFLE's V loop stores whole 16-byte runs but is
a second trip to memory after the main loop, which pays only once the call is long enough; a
K/V head whose per-token scale makes its path per token the longest is dealt to several
groups of threads, each taking its turn at the passes' tokens, which shortens that path per
pass but takes lanes from the other heads. `benchmarks/tune.py` times every depth a library
holds (1..KVF_MAX_PIPELINE_DEPTH) with every tile (the powers of two up to
KVF_MAX_TOKENS_PER_TILE), every lane count the variant has (1..its codegen/lanes.py:
LaneMap.max_sub), and for a transposed V both places (then the best few at every K/V group
count, where the variant has per-token scales), on the GPU and writes tuning/<name>.json;
the runtime only reads those files, so nothing is tuned at run time. A device or variant
without an entry gets 0 for each, the library's defaults; a variant the table does not name
takes the ranges of its twin (`twin`), the variant that differs only in axes that keep the
memory schedule: NeoX for GPT-J, the contract's page sizes, no FP8 query output, per-tensor
for per-token scales (the same bytes; a lane count the twin's library holds, the variant's
holds too).

File format: {"device": "<torch.cuda.get_device_name()>", "abi": LAUNCH_ABI, "choices":
{"<variant uri>": [[max_tokens, depth, tile, v_loop, lanes, groups], ..., [null, depth,
tile, v_loop, lanes, groups]]}}, ranges ascending, the last one open; v_loop is
KVF_V_LOOP_OFF (1) or _ON (2) where V is transposed, else 0; groups one of KV_GROUPS where
the variant has per-token K/V scales, else 0. Only those keys are read; the tuner also
records its provenance ("command", "date", "torch") and where its measured times went
("timings", a file under benchmarks/results/). A table is read only by the launch ABI it was
tuned for (codegen/signature.py: LAUNCH_ABI): what a launch field means may change with it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, Optional

from kvforge.codegen.lanes import lane_map_of
from kvforge.codegen.layout import v_transposed
from kvforge.codegen.model import KvScale, QFp8, Rope
from kvforge.codegen.paths import TUNED

from .abi import (LAUNCH_ABI, DEFAULT_KV_GROUPS, DEFAULT_LANES_PER_THREAD, DEFAULT_PIPELINE_DEPTH,
                  DEFAULT_TOKENS_PER_TILE, KV_GROUPS, MAX_LANES_PER_THREAD, MAX_PIPELINE_DEPTH, TOKENS_PER_TILE,
                  V_LOOP_DEFAULT, V_LOOP_MIN_TOKENS, V_LOOP_OFF, V_LOOP_ON)


class Launch(NamedTuple):
    """One launch configuration; 0 in a field means the library's default."""
    depth: int
    tile: int
    v_loop: int  # KVF_V_LOOP_*: where a transposed V is written
    lanes: int = 0  # head lanes per main-loop thread (kvf_args_t::lanes_per_thread)
    groups: int = 0  # groups per K/V head with per-token scales (kvf_args_t::kv_groups)

    def resolved(self, tokens: int, variant) -> "Launch":
        """What the variant's library runs for a call of `tokens` tokens: defaults filled in
        as launch_at_depth does; v_loop 0 where V is not transposed (there is no V loop),
        groups 0 where the variant has no per-token K/V scales (its heads have one group).
        (A call of one pass, every thread one token, runs at depth 1 and one group whatever
        the launch: the kernel's grid decides that, so it is not modelled here.)"""
        v_loop = V_LOOP_DEFAULT
        if v_transposed(variant):
            v_loop = self.v_loop or (V_LOOP_ON if tokens >= V_LOOP_MIN_TOKENS else V_LOOP_OFF)
        groups = (self.groups or DEFAULT_KV_GROUPS) if splits_kv(variant) else 0
        return Launch(self.depth or DEFAULT_PIPELINE_DEPTH, self.tile or DEFAULT_TOKENS_PER_TILE, v_loop,
                      self.lanes or DEFAULT_LANES_PER_THREAD, groups)

    def problems(self) -> list[str]:
        """Fields outside what a library accepts (0 is the default for each)."""
        accepted = (range(MAX_PIPELINE_DEPTH + 1), (0, *TOKENS_PER_TILE), range(V_LOOP_ON + 1),
                    range(MAX_LANES_PER_THREAD + 1), (0, *KV_GROUPS))
        return [f"{name} must be {_allowed(ok)}, got {value!r}" for name, value, ok in zip(self._fields, self, accepted)
                if type(value) is not int or value not in ok]


def _listed(values) -> str:
    return ", ".join(map(str, values))


def _allowed(values) -> str:
    return f"0..{values[-1]}" if isinstance(values, range) else f"one of {_listed(values)}"


DEFAULT = Launch(0, 0, V_LOOP_DEFAULT, 0, 0)
Ranges = tuple[tuple[Optional[int], Launch], ...]  # ((max_tokens or None, launch), ...)


class TuningError(ValueError):
    pass


def splits_kv(variant) -> bool:
    """Whether the variant's K/V heads may have several groups (kvf_args_t::kv_groups): where
    their values are divided by a per-token scale (the kernel's Fused::kSplitKv)."""
    return variant.kv_scale.dynamic


def lanes_problem(variant, lanes: int) -> Optional[str]:
    """Why `variant`'s library has no kernel for `lanes` head lanes per thread, if so."""
    most = lane_map_of(variant).max_sub
    return None if lanes <= most else (f"lanes must be at most {most} for {variant.uri} (rotary halves not "
                                       f"8-aligned, or one lane per head), got {lanes}")


@dataclass(frozen=True)
class Table:
    device: str
    choices: dict[str, Ranges]
    where: str = "<table>"  # the file it was read from, for errors

    def ranges_for(self, variant) -> Ranges:
        """The variant's ranges (or its NeoX twin's, see the module's doc). The file alone
        cannot tell how many lanes a variant's kernels hold, so a range naming more is
        refused here, at the variant's first call, rather than by the library at every call."""
        ranges = self.choices.get(variant.uri)
        if ranges is None:
            ranges = self.choices.get(twin(variant).uri)
        ranges = ranges or ()
        for i, (_, launch) in enumerate(ranges):
            bad = lanes_problem(variant, launch.lanes)
            if bad:
                raise TuningError(f"{self.where}: range {i}: {bad}: re-run benchmarks/tune.py")
        return ranges


def twin(variant):
    """The variant whose tuned launches an untuned one takes (see the module's doc)."""
    c = variant.contract
    kv_scale = variant.kv_scale
    if kv_scale.dynamic and KvScale.PER_TENSOR in c.scales:
        kv_scale = KvScale.PER_TENSOR
    fp8 = variant.fp8 if kv_scale is not KvScale.NONE or variant.index_fp8 else None
    return dataclasses.replace(variant, rope=Rope.NEOX, q_fp8=QFp8.NONE, kv_page_size=c.k.page_size,
                               index_page_size=c.index.page_size, kv_scale=kv_scale, fp8=fp8)


def pick(ranges: Ranges, tokens: int) -> Launch:
    for upto, launch in ranges:
        if upto is None or tokens <= upto:
            return launch
    return DEFAULT


def parse(data, where: str) -> Table:
    """A table from decoded JSON; errors name the file and the entry."""
    if not isinstance(data, dict) or not isinstance(data.get("device"), str):
        raise TuningError(f"{where}: expected an object with a 'device' name")
    abi = data.get("abi")
    if type(abi) is not int or abi != LAUNCH_ABI:
        found = "names no ABI (it predates ABI 5)" if abi is None else f"was tuned for ABI {abi!r}"
        raise TuningError(f"{where}: {found}, but this runtime's launches are ABI {LAUNCH_ABI} "
                          f"(a field may mean something else): re-run benchmarks/tune.py")
    choices = data.get("choices")
    if not isinstance(choices, dict):
        raise TuningError(f"{where}: 'choices' must map variant names to token ranges")
    out: dict[str, Ranges] = {}
    for uri, ranges in choices.items():
        if not isinstance(ranges, list) or not ranges:
            raise TuningError(f"{where}: {uri}: expected a list of [max_tokens, depth, tile, v_loop, lanes, groups] "
                              "entries")
        parsed, last = [], 0
        for i, item in enumerate(ranges):
            ok = isinstance(item, list) and len(item) == 6
            upto, depth, tile, v_loop, lanes, groups = item if ok else (None,) * 6
            open_end = upto is None and i == len(ranges) - 1
            if not ok or not (open_end or (type(upto) is int and upto > last)):
                raise TuningError(f"{where}: {uri}: range {i}: expected [max_tokens > {last}, depth, tile, v_loop, "
                                  f"lanes, groups] (max_tokens null only in the last), got {item!r}")
            if type(depth) is not int or not 1 <= depth <= MAX_PIPELINE_DEPTH:
                raise TuningError(f"{where}: {uri}: range {i}: depth must be 1..{MAX_PIPELINE_DEPTH}, "
                                  f"got {depth!r}")
            if type(tile) is not int or tile not in TOKENS_PER_TILE:
                raise TuningError(f"{where}: {uri}: range {i}: tile must be one of {_listed(TOKENS_PER_TILE)}, "
                                  f"got {tile!r}")
            if type(v_loop) is not int or not V_LOOP_DEFAULT <= v_loop <= V_LOOP_ON:
                raise TuningError(f"{where}: {uri}: range {i}: v_loop must be {V_LOOP_DEFAULT} (default), "
                                  f"{V_LOOP_OFF} (off) or {V_LOOP_ON} (on), got {v_loop!r}")
            if type(lanes) is not int or not 1 <= lanes <= MAX_LANES_PER_THREAD:
                raise TuningError(f"{where}: {uri}: range {i}: lanes must be 1..{MAX_LANES_PER_THREAD}, "
                                  f"got {lanes!r}")
            if type(groups) is not int or groups not in (0, *KV_GROUPS):
                raise TuningError(f"{where}: {uri}: range {i}: groups must be 0 (default) or one of "
                                  f"{_listed(KV_GROUPS)}, got {groups!r}")
            parsed.append((upto, Launch(depth, tile, v_loop, lanes, groups)))
            last = upto if upto is not None else last
        out[uri] = tuple(parsed)
    return Table(device=data["device"], choices=out, where=where)


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise TuningError(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise TuningError(f"{path}:{e.lineno}: not JSON: {e.msg}") from None


def load(path: Path) -> Table:
    return parse(_read(path), str(path))


@lru_cache(maxsize=None)
def table_for(device: str, root: Path = TUNED) -> Optional[Table]:
    """The tuned table for a device name (e.g. 'NVIDIA H200'), if one is stored. Only
    that device's file is parsed (a broken file for another GPU does not matter here);
    two files for one device are an error, not a silent choice."""
    found = []
    for path in sorted(root.glob("*.json")) if root.is_dir() else ():
        data = _read(path)
        if isinstance(data, dict) and data.get("device") == device:
            found.append((path, data))
    if len(found) > 1:
        raise TuningError(f"{root}: {', '.join(p.name for p, _ in found)} all tune {device!r}; keep one")
    return parse(found[0][1], str(found[0][0])) if found else None


def launch_used(device: str, variant, tokens: int) -> Launch:
    """The launch a call of `tokens` tokens gets on `device`, defaults resolved (for reports)."""
    table = table_for(device)
    launch = pick(table.ranges_for(variant), tokens) if table else DEFAULT
    return launch.resolved(tokens, variant)
