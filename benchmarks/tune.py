"""Tune the launch (pipeline depth, tokens per tile, where a transposed V is written) per
variant and token range on this GPU.

    python benchmarks/tune.py [--name h200] [--tokens 1,16,128,512,1024,2048,4096,8192,32768,65536]
                              [--all] [--resume]

For each variant (default: the MiniMax-M3 variants bench.py measures; --all: every
variant in variants.yaml) and token count, every depth a library holds
(1..KVF_MAX_PIPELINE_DEPTH) with every tile (1..KVF_MAX_TOKENS_PER_TILE), and for a
transposed V (SHUFFLE) with V in the main loop and in the V loop, is checked against
the reference, then timed under CUDA-graph replay with inputs rotated past L2, as
bench.py times (decode slots up to 256 tokens, prefill above). A launch other than the
library's defaults is chosen only when it is more than 2% faster. Where V is transposed,
counts of 257..DECODE_MAX_TOKENS are also timed as decodes at the chosen depth and tile,
and V's place is the one whose worse slowdown over the two slot patterns is smaller.
Token ranges are split at the geometric midpoints between the measured counts; the table
goes to tuning/<name>.json, which the runtime reads (runtime/tuning.py). Nothing is tuned
at run time. Shapes: 4 kv heads are timed at TP1 (64, 4, 4 heads), 1 kv head at TP8.

Each variant's results also go to <name>.json.partial as it finishes; --resume takes the
variants found there (same command and device) instead of timing them again.
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
from codegen.layout import v_transposed  # noqa: E402
from codegen.model import IndexMode  # noqa: E402
from codegen.paths import TUNED  # noqa: E402
from runtime import build, toolchain  # noqa: E402
from runtime.abi import (ABI_VERSION, MAX_PIPELINE_DEPTH, MAX_TOKENS_PER_TILE, V_LOOP_DEFAULT,  # noqa: E402
                         V_LOOP_OFF, V_LOOP_ON)
from runtime.api import launch_with  # noqa: E402
from runtime.registry import source_of, spec  # noqa: E402
from runtime.testing import check_against_reference  # noqa: E402
from runtime.tuning import DEFAULT, Launch, parse  # noqa: E402

MARGIN = 0.02
# The table is keyed by token count alone, so one launch serves a count whatever its
# slots. Decode batches this large are plausible (an engine's decode step has up to
# max_num_seqs tokens, each in its own page), and there V in the main loop was 1.3-2.6x
# faster than the V loop while prefills of those counts favoured the V loop by up to 6%
# (benchmarks/NOTES.md, v6.8).
DECODE_MAX_TOKENS = 4096


def launches(v) -> list[Launch]:
    """Every launch the variant's library distinguishes."""
    places = (V_LOOP_OFF, V_LOOP_ON) if v_transposed(v) else (V_LOOP_DEFAULT,)
    return [Launch(d, t, p) for d in range(1, MAX_PIPELINE_DEPTH + 1)
            for t in range(1, MAX_TOKENS_PER_TILE + 1) for p in places]


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


def v_place(prefill: dict[Launch, float], decode: dict[Launch, float]) -> Launch:
    """Of launches that differ in V's place only (both timed with both slot patterns), the
    one whose worse slowdown against the faster place of the same pattern is smaller."""
    def worst(launch: Launch) -> float:
        return max(prefill[launch] / min(prefill.values()), decode[launch] / min(decode.values()))
    return min(decode, key=worst)


def tune_variant(v, tokens: list[int]) -> tuple[list, dict]:
    """The variant's table entry and what was measured (µs by launch, per count)."""
    picks, measured = [], {}
    for t in tokens:
        times = time_launches(v, t, launches(v))
        pick = choose(times, DEFAULT.resolved(t, v_transposed(v)))
        measured[str(t)] = {f"depth{d}-tile{k}-vloop{p}": round(us, 3) for (d, k, p), us in times.items()}
        line = "  ".join(f"d{d}t{k}v{p} {us:.2f} us" for (d, k, p), us in times.items())
        if v_transposed(v) and DECODE_UP_TO < t <= DECODE_MAX_TOKENS:
            both = [pick._replace(v_loop=p) for p in (V_LOOP_OFF, V_LOOP_ON)]
            decode = time_launches(v, t, both, slots="decode")
            pick = v_place({launch: times[launch] for launch in both}, decode)
            measured[str(t)].update({f"decode-depth{d}-tile{k}-vloop{p}": round(us, 3)
                                     for (d, k, p), us in decode.items()})
            line += "  decode: " + "  ".join(f"v{p} {us:.2f} us" for (_, _, p), us in decode.items())
        picks.append((t, pick))
        print(f"{v.uri} T={t}: {line}  -> depth {pick.depth} tile {pick.tile} v_loop {pick.v_loop}", flush=True)
    return ranges(picks), measured


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
    # 2048 and 4096 besides bench.py's counts: SHUFFLE's V loop starts to pay there at one
    # kv head (at four, between 512 and 2048).
    # 512 because FP8 with 4 kv heads changes V's place between 128 and 1024 tokens.
    ap.add_argument("--tokens", default="1,16,128,512,1024,2048,4096,8192,32768,65536")
    ap.add_argument("--all", action="store_true", help="every listed variant, not only the benchmark's")
    ap.add_argument("--resume", action="store_true", help="take the variants <name>.json.partial holds")
    args = ap.parse_args()
    if args.all:
        variants = list(spec().variants)
    else:
        variants = sorted({find_variant(axes, nkv) for axes in CONFIGS.values() for nkv in (1, 4)},
                          key=lambda v: v.uri)
    build.build_many([build.Job(v.uri, source_of(v)) for v in variants], toolchain.default())
    tokens = sorted(map(int, args.tokens.split(",")))
    if len(set(tokens)) != len(tokens) or tokens[0] < 1:
        ap.error(f"--tokens: expected distinct positive counts, got {args.tokens}")
    table = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "abi": ABI_VERSION,
             "command": f"python benchmarks/tune.py --name {args.name} --tokens {args.tokens}"
                        + (" --all" if args.all else ""),
             "choices": {}, "measured_us": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{args.name}.json.partial"
    if args.resume and partial.exists():
        done = json.loads(partial.read_text())
        if any(done.get(k) != table[k] for k in ("device", "torch", "abi", "command")):
            ap.error(f"--resume: {partial} was made by another command, device or build; remove it")
        table.update(choices=done["choices"], measured_us=done["measured_us"])
        print(f"resuming: {len(done['choices'])} variants from {partial}", flush=True)
    for v in variants:
        if v.uri in table["choices"]:
            continue
        table["choices"][v.uri], table["measured_us"][v.uri] = tune_variant(v, tokens)
        partial.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    parse(table, "tuner output")  # what the runtime will accept
    (out / f"{args.name}.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    partial.unlink()
    print(f"wrote {out / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
