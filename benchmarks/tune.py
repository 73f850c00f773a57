"""Tune the launch (pipeline depth, tokens per tile, where a transposed V is written) per
variant and token range on this GPU.

    python benchmarks/tune.py [--name h200] [--tokens 1,16,128,512,1024,2048,4096,8192,32768,65536]
                              [--all] [--resume]

For each variant (default: the MiniMax-M3 variants bench.py measures; --all: every
variant in variants.yaml) and token count, every depth a library holds
(1..KVF_MAX_PIPELINE_DEPTH) with every tile (the powers of two up to
KVF_MAX_TOKENS_PER_TILE) and every count of head lanes per thread the variant has
(codegen/layout.py: max_lanes_per_thread), and for a transposed V (SHUFFLE) with V in the
main loop and in the V loop, is checked against the reference, then timed under CUDA-graph replay with
inputs rotated past L2, as bench.py times (decode slots up to 256 tokens, prefill
above). A launch other than the library's defaults is chosen only when it is more than
2% faster. Where V is transposed, counts of 257..DECODE_MAX_TOKENS are also timed as
decodes, each V place at its best depth and tile for prefills, and V's place is the one
whose worse slowdown over the two slot patterns is smaller (again by more than 2% to
move). Token ranges are split at the geometric midpoints between the measured counts (so
the last decode-timed count's choice reaches to the midpoint above it); the table goes
to tuning/<name>.json, with the build key of each variant it timed; the runtime reads it
(runtime/tuning.py). Nothing is tuned at run time. Shapes: 4 kv heads are timed at TP1
(64, 4, 4 heads), 1 kv head at TP8. Counts that fit one pass of the grid (every thread
one token) run at depth 1 whatever the depth, so there the depths time the same kernel
and the 2% rule keeps the default.

Each variant's results also go to <name>.json.partial as it finishes; --resume takes the
variants found there whose build is unchanged (same command, device and torch) instead of
timing them again. A run cut short leaves that file; another run refuses to overwrite it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench import CONFIGS, DECODE_UP_TO, TP, find_variant, graph_us, input_sets  # noqa: E402
from codegen.layout import max_lanes_per_thread, v_transposed  # noqa: E402
from codegen.model import IndexMode  # noqa: E402
from codegen.paths import TUNED  # noqa: E402
from runtime import build, toolchain  # noqa: E402
from runtime.abi import (ABI_VERSION, MAX_PIPELINE_DEPTH, TOKENS_PER_TILE, V_LOOP_DEFAULT,  # noqa: E402
                         V_LOOP_OFF, V_LOOP_ON)
from runtime.api import launch_with  # noqa: E402
from runtime.registry import source_of, spec  # noqa: E402
from runtime.testing import check_against_reference  # noqa: E402
from runtime.tuning import DEFAULT, Launch, parse  # noqa: E402

MARGIN = 0.02
# The table is keyed by token count alone, so one launch serves a count whatever its
# slots. Decode batches this large are plausible (an engine's decode step has up to
# max_num_seqs tokens, each in its own page), and there V in the main loop was 1.3-2.6x
# faster than the V loop while prefills of those counts favoured the V loop by up to 9%
# (benchmarks/NOTES.md, v6.8).
DECODE_MAX_TOKENS = 4096


def launches(v) -> list[Launch]:
    """Every launch the variant's library distinguishes."""
    places = (V_LOOP_OFF, V_LOOP_ON) if v_transposed(v) else (V_LOOP_DEFAULT,)
    lanes = range(1, max_lanes_per_thread(v.head_dim, v.rotary_dim) + 1)
    return [Launch(d, t, p, n) for d in range(1, MAX_PIPELINE_DEPTH + 1) for t in TOKENS_PER_TILE for p in places
            for n in lanes]


def time_launches(v, tokens: int, candidates: list[Launch], slots: Optional[str] = None) -> dict[Launch, float]:
    nq, _, niq = TP[1] if v.num_kv_heads == 4 else TP[8]
    niq = niq if v.index_mode is not IndexMode.NONE else 0
    sets, _, _, n_calls = input_sets(v, tokens, nq, niq, slots=slots)
    n_sets = len(sets)
    out = {}
    for launch in candidates:
        check_against_reference(sets[0], lambda **a: launch_with(launch, **a)(), ref_device="cuda")
        calls = [launch_with(launch, **s) for s in sets]
        out[launch] = graph_us([calls[i % n_sets] for i in range(n_calls)])
    del sets
    torch.cuda.empty_cache()
    return out


def choose(times: dict[Launch, float], default: Launch) -> Launch:
    """`default` (resolved, one of the timed launches) unless another is clearly faster."""
    best = min(times, key=times.get)
    return best if times[best] < (1 - MARGIN) * times[default] else default


def v_place(prefill: dict[Launch, float], decode: dict[Launch, float], current: Launch) -> Launch:
    """Of the launches timed with both slot patterns (one per V place), the one whose worse
    slowdown against the faster of the same pattern is smaller; `current` unless another's
    is clearly smaller."""
    def worst(launch: Launch) -> float:
        return max(prefill[launch] / min(prefill.values()), decode[launch] / min(decode.values()))
    best = min(decode, key=worst)
    return best if worst(best) < (1 - MARGIN) * worst(current) else current


def tune_variant(v, tokens: list[int]) -> tuple[list, dict]:
    """The variant's table entry and what was measured (µs by launch, per count)."""
    picks, measured = [], {}
    for t in tokens:
        times = time_launches(v, t, launches(v))
        pick = choose(times, DEFAULT.resolved(t, v_transposed(v)))
        measured[str(t)] = {_key(launch): round(us, 3) for launch, us in times.items()}
        line = "  ".join(f"d{d}t{k}v{p}l{n} {us:.2f} us" for (d, k, p, n), us in times.items())
        if v_transposed(v) and DECODE_UP_TO < t <= DECODE_MAX_TOKENS:
            # the pick, and the other place at its best depth, tile and lanes
            both = [pick if p == pick.v_loop else min((x for x in times if x.v_loop == p), key=times.get)
                    for p in (V_LOOP_OFF, V_LOOP_ON)]
            decode = time_launches(v, t, both, slots="decode")
            pick = v_place({launch: times[launch] for launch in both}, decode, pick)
            measured[str(t)].update({"decode-" + _key(launch): round(us, 3) for launch, us in decode.items()})
            line += "  decode: " + "  ".join(f"d{d}t{k}v{p}l{n} {us:.2f} us" for (d, k, p, n), us in decode.items())
        picks.append((t, pick))
        print(f"{v.uri} T={t}: {line}  -> depth {pick.depth} tile {pick.tile} v_loop {pick.v_loop} "
              f"lanes {pick.lanes}", flush=True)
    return ranges(picks), measured


def _key(launch: Launch) -> str:
    return "depth{}-tile{}-vloop{}-lanes{}".format(*launch)


def ranges(choices: list[tuple[int, Launch]]) -> list[list]:
    """[(tokens, launch)] measured → [[max_tokens, *launch], ..., [None, *launch]]."""
    out: list[list] = []
    for i, (tokens, launch) in enumerate(choices):
        upto = None if i + 1 == len(choices) else int(math.sqrt(tokens * choices[i + 1][0]))
        if out and out[-1][1:] == list(launch):
            out[-1][0] = upto
        else:
            out.append([upto, *launch])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="h200", help="writes tuning/<name>.json")
    ap.add_argument("--out", default=str(TUNED))
    # 512, 2048 and 4096 besides bench.py's counts: where SHUFFLE's V loop starts to pay
    # for prefills (between 128 and 1024 tokens for FP8 at four kv heads, 4096 at one).
    ap.add_argument("--tokens", default="1,16,128,512,1024,2048,4096,8192,32768,65536")
    ap.add_argument("--all", action="store_true", help="every listed variant, not only the benchmark's")
    ap.add_argument("--resume", action="store_true", help="take the variants <name>.json.partial holds")
    args = ap.parse_args()
    if args.all:
        variants = list(spec().variants)
    else:
        variants = sorted({find_variant(axes, nkv) for axes in CONFIGS.values() for nkv in (1, 4)},
                          key=lambda v: v.uri)
    tc = toolchain.default()
    jobs = [build.Job(v.uri, source_of(v)) for v in variants]
    build.build_many(jobs, tc)
    tokens = sorted(map(int, args.tokens.split(",")))
    if len(set(tokens)) != len(tokens) or tokens[0] < 1:
        ap.error(f"--tokens: expected distinct positive counts, got {args.tokens}")
    table = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "abi": ABI_VERSION,
             "command": f"python benchmarks/tune.py --name {args.name} --tokens {args.tokens}"
                        + (" --all" if args.all else ""),
             "builds": {job.uri: build.cache_key(job.source, tc) for job in jobs},
             "choices": {}, "measured_us": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{args.name}.json.partial"
    if partial.exists() and not args.resume:
        ap.error(f"{partial} holds a run cut short: pass --resume to continue it, or remove it")
    if args.resume and partial.exists():
        done = json.loads(partial.read_text())
        if any(done.get(k) != table[k] for k in ("device", "torch", "abi", "command")):
            ap.error(f"--resume: {partial} was made by another command, device or torch; remove it")
        kept = [uri for uri in done["choices"] if done["builds"].get(uri) == table["builds"].get(uri)]
        for uri in kept:
            table["choices"][uri], table["measured_us"][uri] = done["choices"][uri], done["measured_us"][uri]
        changed = len(done["choices"]) - len(kept)
        print(f"resuming: {len(kept)} variants from {partial}"
              + (f" ({changed} re-timed: their builds changed)" if changed else ""), flush=True)
    for v in variants:
        if v.uri in table["choices"]:
            continue
        table["choices"][v.uri], table["measured_us"][v.uri] = tune_variant(v, tokens)
        build.write_if_different(partial, json.dumps(table, indent=1, sort_keys=True) + "\n")
    parse(table, "tuner output")  # what the runtime will accept
    build.write_if_different(out / f"{args.name}.json", json.dumps(table, indent=1, sort_keys=True) + "\n")
    partial.unlink(missing_ok=True)
    print(f"wrote {out / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
