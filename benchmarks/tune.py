"""Tune the launch (pipeline depth, tokens per tile, where a transposed V is written, head
lanes per thread, groups per K/V head with per-token scales) per variant and token range on
this GPU.

    python benchmarks/tune.py [--name h200] [--tokens 1,16,128,512,1024,2048,4096,8192,32768,65536]
                              [--all] [--filter GLOB] [--exclude GLOB] [--resume] [--budget-s S]
                              [--confirm-within 0.05] [--out DIR] [--results DIR]

For each variant (default: the MiniMax-M3 variants bench.py measures; --all: every variant
in variants.yaml; --filter / --exclude: of those, the ones whose name matches, as
`python -m kvforge.codegen --filter` selects) and token count, every depth a library holds
(1..KVF_MAX_PIPELINE_DEPTH) with every tile (the powers of two up to
KVF_MAX_TOKENS_PER_TILE) and every count of head lanes per thread the variant has
(codegen/lanes.py: LaneMap.max_sub), and for a transposed V (SHUFFLE) with V in the main
loop and in the V loop, is checked against the reference, then timed under CUDA-graph replay
with inputs rotated past L2, as bench.py times (decode slots up to 256 tokens, prefill
above). Where the variant's K/V heads have per-token scales, that sweep runs at the default
count of groups per K/V head, and the launches within --confirm-within of its best (the
finalists below; 5% where that is 0) are timed at every other count too: the count changes
only how a K/V head's tokens are dealt to threads, so it is tried on the launches that could
win, not multiplied into the sweep. It is timed at each TP of bench.py the variant serves (4
kv heads: TP1's 64, 4, 4 heads; 1 kv head: TP4's 16, 1, 1 and TP8's 8, 1, 1), since the
table, keyed by token count alone, gives them one launch: the launch chosen is the one whose
worst slowdown over those TPs is smallest, and one other than the library's defaults only
when that is more than 2% smaller (with one TP: when it is more than 2% faster). The
launches whose worst slowdown is within --confirm-within (5%) of the smallest, and the
default, are timed again (new buffers, reverse order), each keeping its faster time: one
timing can be a few % slow, which the 2% rule would take for a real difference. Where V is
transposed, counts of 257..DECODE_MAX_TOKENS are also timed as decodes, the choice and the
other V place's best, and V's place is the one whose worst slowdown over prefills and
decodes is smaller (again by more than 2% to move). Token ranges are split at the geometric
midpoints between the measured counts (so the last decode-timed count's choice reaches to
the midpoint above it); the table goes to tuning/<name>.json (the choices, one line per
variant, and their provenance: command, date, GPU, torch, ABI), which the runtime reads
(runtime/tuning.py), and every time measured to benchmarks/results/<name>_tune.jsonl (a
header line with the build key of each variant timed, then one line per variant, count and
pattern); with --out DIR both go to DIR unless --results names another. Nothing is tuned at
run time. Counts that fit one pass of the grid (every thread one token) run at depth 1 and
one K/V group whatever the launch, so there the depths and group counts time the same
kernel: the 2% rule keeps the default depth where nothing else differs, and a group count
chosen there is one the library does not use.

A run with --filter or --exclude re-tunes those variants within the table it finds at
<name>.json: the others keep their choices and timings, and the table lists the run under
"retuned" (its command, date, torch and variants) beside the first run's provenance. It is
refused where that table is another device's or ABI's, its timings file is missing or of
another tuner format or run, or was measured at other token counts (`base_of`); without a
table there it writes one of its variants alone.

Each count's times go to <name>.json.partial as it is measured; --resume takes what it
finds there for variants whose build is unchanged (same command, device, torch, ABI and
tuner format) and times only the rest. A run cut short leaves that file; another run
refuses to overwrite it. --budget-s stops the run (exit status 3) before a count it could
not finish in that many seconds from its start, judged by the most seconds per launch of
its sweep (confirm round and decodes included) at that count and TPs so far (a count's
first measurement is not guarded; the confirm round's size varies), leaving the
file for --resume: a tune may take longer than one device call. The choices follow from
the measured times alone (`pick`), so the timings file re-derives the table's choices.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench import CONFIGS, DECODE_UP_TO, TP, find_variant, graph_us, hang_watchdog, input_sets  # noqa: E402
from benchmarks.report import RESULTS  # noqa: E402
from kvforge.codegen.lanes import lane_map_of  # noqa: E402
from kvforge.codegen.layout import v_transposed  # noqa: E402
from kvforge.codegen.model import IndexMode, select  # noqa: E402
from kvforge.codegen.paths import TUNED  # noqa: E402
from kvforge.runtime import build, toolchain  # noqa: E402
from kvforge.runtime.abi import (KV_GROUPS, LAUNCH_ABI, MAX_PIPELINE_DEPTH, TOKENS_PER_TILE,  # noqa: E402
                                 V_LOOP_DEFAULT, V_LOOP_OFF, V_LOOP_ON)
from kvforge.runtime.api import launch_with  # noqa: E402
from kvforge.runtime.registry import source_of, spec  # noqa: E402
from kvforge.runtime.testing import ReferenceCheck  # noqa: E402
from kvforge.runtime.tuning import DEFAULT, Launch, parse, splits_kv  # noqa: E402

MARGIN = 0.02
# The layout of measured_us (3: µs by launch per pattern, "tp8" or "tp8-decode", launches
# keyed with their K/V groups); --resume takes no partial of another.
TUNER_FORMAT = 3
# The table is keyed by token count alone, so one launch serves a count whatever its
# slots. Decode batches this large are plausible (an engine's decode step has up to
# max_num_seqs tokens, each in its own page), and there V in the main loop was 1.3-2.6x
# faster than the V loop while prefills of those counts favoured the V loop by up to 9%
# (benchmarks/PERF.md, v6.8).
DECODE_MAX_TOKENS = 4096
CONFIRM_WITHIN = 0.05


def sweep(v) -> list[Launch]:
    """Every launch the variant's library distinguishes at the default K/V groups."""
    places = (V_LOOP_OFF, V_LOOP_ON) if v_transposed(v) else (V_LOOP_DEFAULT,)
    lanes = range(1, lane_map_of(v).max_sub + 1)
    groups = DEFAULT.resolved(1, v).groups
    return [Launch(d, t, p, n, groups) for d in range(1, MAX_PIPELINE_DEPTH + 1) for t in TOKENS_PER_TILE
            for p in places for n in lanes]


def regrouped(v, candidates: list[Launch]) -> list[Launch]:
    """The candidates at every other count of K/V groups the variant's library takes (none
    where it has no per-token K/V scales)."""
    if not splits_kv(v):
        return []
    return [c._replace(groups=g) for c in candidates for g in KV_GROUPS if g != c.groups]


def launches(v) -> list[Launch]:
    """Every launch the variant's library distinguishes."""
    swept = sweep(v)
    return [*swept, *regrouped(v, swept)]


def tps(v) -> list[int]:
    """The TPs of bench.py whose kv-head count is the variant's (4: TP1; 1: TP4 and TP8).
    The table is keyed by token count alone, so one launch serves each of them; a variant
    of another kv-head count is timed with TP8's q and index heads."""
    return [tp for tp, (_, nkv, _) in TP.items() if nkv == v.num_kv_heads] or [8]


def launches_per_count(v) -> int:
    """Launches a count's sweep times (the K/V groups' and confirm rounds and decodes aside):
    --budget-s's estimate is seconds per such launch, a count's whole time over them."""
    return len(sweep(v)) * len(tps(v))


def time_launches(v, tokens: int, candidates: list[Launch], tp: int,
                  slots: Optional[str] = None) -> dict[Launch, float]:
    """µs per call of each candidate at TP `tp`'s q and index heads, each checked against
    the reference first."""
    nq, _, niq = TP[tp]
    niq = niq if v.index_mode is not IndexMode.NONE else 0
    sets, _, _, n_calls = input_sets(v, tokens, nq, niq, slots=slots)
    n_sets = len(sets)
    check = ReferenceCheck(sets[0], ref_device="cuda")
    out = {}
    for launch in candidates:
        check(lambda **a: launch_with(launch, **a)())
        calls = [launch_with(launch, **s) for s in sets]
        out[launch] = round(graph_us([calls[i % n_sets] for i in range(n_calls)]), 3)
    del sets, check, calls
    torch.cuda.empty_cache()
    return out


Patterns = dict[str, dict[Launch, float]]  # µs by launch, per pattern ("tp8", "tp8-decode")


def _timed_in_every(patterns: Patterns) -> list[Launch]:
    return [launch for launch in next(iter(patterns.values())) if all(launch in t for t in patterns.values())]


def worst(patterns: Patterns, launch: Launch) -> float:
    """The launch's largest slowdown against the fastest launch timed in the same pattern."""
    return max(times[launch] / min(times.values()) for times in patterns.values())


def choose(patterns: Patterns, current: Launch) -> Launch:
    """Of the launches timed in every pattern, the one whose worst slowdown is smallest;
    `current` (one of them) unless another's is more than MARGIN smaller. With one pattern,
    the fastest unless `current` is within MARGIN of it."""
    best = min(_timed_in_every(patterns), key=lambda launch: (worst(patterns, launch), launch))  # ties: any order
    return best if worst(patterns, best) < (1 - MARGIN) * worst(patterns, current) else current


def finalists(patterns: Patterns, current: Launch, within: float) -> list[Launch]:
    """The launches timed in every pattern whose worst slowdown is within `within` of the
    smallest, and `current`: those `choose` could take if their times moved by that much."""
    timed = _timed_in_every(patterns)
    best = min(worst(patterns, launch) for launch in timed)
    return sorted({launch for launch in timed if worst(patterns, launch) <= (1 + within) * best} | {current})


def measure_count(v, tokens: int, confirm_within: float) -> dict[str, dict[str, float]]:
    """µs by launch key (`_key`) per pattern: the sweep at each of the variant's TPs ("tp8",
    slots as bench.py sets them), its `finalists` within `confirm_within` (or
    CONFIRM_WITHIN where that is 0) at the other K/V group counts (`regrouped`), then the
    finalists of all those within `confirm_within` timed again (new buffers, reverse order)
    keeping each one's faster time; where V is transposed and the count may be a decode,
    also the prefills' pick and the other V place's best with decode slots ("tp8-decode"),
    timed once."""
    current = DEFAULT.resolved(tokens, v)
    prefill = {f"tp{tp}": time_launches(v, tokens, sweep(v), tp) for tp in tps(v)}
    more = regrouped(v, finalists(prefill, current, confirm_within or CONFIRM_WITHIN))
    if more:
        for tp in tps(v):
            prefill[f"tp{tp}"].update(time_launches(v, tokens, more, tp))
    again = finalists(prefill, current, confirm_within) if confirm_within > 0 else []
    if len(again) > 1:
        for tp in tps(v):
            times = prefill[f"tp{tp}"]
            for launch, us in time_launches(v, tokens, again[::-1], tp).items():
                times[launch] = min(times[launch], us)
    out = {name: {_key(launch): us for launch, us in times.items()} for name, times in prefill.items()}
    if v_transposed(v) and DECODE_UP_TO < tokens <= DECODE_MAX_TOKENS:
        first = choose(prefill, current)
        other = min((x for x in _timed_in_every(prefill) if x.v_loop != first.v_loop),
                    key=lambda x: (worst(prefill, x), x))
        for tp in tps(v):
            out[f"tp{tp}-decode"] = {_key(launch): us for launch, us in
                                     time_launches(v, tokens, [first, other], tp, "decode").items()}
    return out


def pick(v, tokens: int, measured: dict[str, dict[str, float]]) -> Launch:
    """The launch for `tokens` from what `measure_count` measured there, so a table's
    choices follow from its measured_us alone: the prefills' choice over the TPs, then V's
    place over prefills and decodes where decodes were timed."""
    patterns = {name: {_launch(key): us for key, us in times.items()} for name, times in measured.items()}
    prefill = {name: times for name, times in patterns.items() if not name.endswith("-decode")}
    chosen = choose(prefill, DEFAULT.resolved(tokens, v))
    return choose(patterns, chosen) if len(patterns) > len(prefill) else chosen


def _key(launch: Launch) -> str:
    return "depth{}-tile{}-vloop{}-lanes{}-groups{}".format(*launch)


def _launch(key: str) -> Launch:
    return Launch(*map(int, re.fullmatch(r"depth(\d+)-tile(\d+)-vloop(\d+)-lanes(\d+)-groups(\d+)", key).groups()))


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


# What the runtime's table holds (runtime/tuning.py reads device, abi and choices; the rest
# is provenance), and what the timings file's header line holds.
# "retuned" only where runs with --filter/--exclude re-tuned some variants since.
TABLE_KEYS = ("device", "abi", "command", "date", "torch", "retuned", "timings", "choices")
TIMINGS_KEYS = ("device", "abi", "command", "date", "torch", "retuned", "tuner", "builds")


def table_text(table: dict) -> str:
    """tuning/<name>.json: TABLE_KEYS of the tuner's state, one per line, each variant's
    ranges on one line."""
    lines = [f" {json.dumps(k)}: {json.dumps(table[k])}," for k in TABLE_KEYS if k != "choices" and k in table]
    choices = [f"  {json.dumps(uri)}: {json.dumps(r)}" for uri, r in sorted(table["choices"].items())]
    body = ' "choices": ' + ("{\n" + ",\n".join(choices) + "\n }" if choices else "{}")
    return "{\n" + "\n".join(lines) + "\n" + body + "\n}\n"


def timings_text(table: dict) -> str:
    """benchmarks/results/<name>_tune.jsonl: a header line (TIMINGS_KEYS), then one line per
    variant, token count and pattern with the µs of every launch timed there."""
    lines = [json.dumps({k: table[k] for k in TIMINGS_KEYS if k in table}, sort_keys=True)]
    for uri, counts in sorted(table["measured_us"].items()):
        for t in sorted(counts, key=int):
            for pattern, us in sorted(counts[t].items()):
                lines.append(json.dumps({"variant": uri, "tokens": int(t), "pattern": pattern, "us": us},
                                        sort_keys=True))
    return "\n".join(lines) + "\n"


def read_timings(text: str) -> dict:
    """A timings file's header with its times gathered back as measured_us:
    {variant: {str(tokens): {pattern: {launch key: µs}}}}."""
    header, *records = (json.loads(line) for line in text.splitlines() if line.strip())
    measured: dict = {}
    for r in records:
        measured.setdefault(r["variant"], {}).setdefault(str(r["tokens"]), {})[r["pattern"]] = r["us"]
    return dict(header, measured_us=measured)


def base_of(table_path: Path, timings_path: Path, run: dict, tokens: list[int]) -> Optional[dict]:
    """The table a run with --filter/--exclude re-tunes within, its timings gathered back
    (read_timings), or None where there is none. A ValueError says why the run may not be
    laid over it."""
    if not table_path.exists():
        return None
    base = json.loads(table_path.read_text())
    if (base.get("device"), base.get("abi")) != (run["device"], run["abi"]):
        raise ValueError(f"{table_path} was tuned on {base.get('device')} at ABI {base.get('abi')}, "
                         f"not {run['device']} at ABI {run['abi']}: re-tune it whole")
    if not timings_path.exists():
        raise ValueError(f"{table_path}: its timings {timings_path} are missing: re-tune it whole")
    timings = read_timings(timings_path.read_text())
    if timings.get("tuner") != run["tuner"] or \
            (timings.get("command"), timings.get("date")) != (base.get("command"), base.get("date")):
        raise ValueError(f"{timings_path} holds another run's timings than {table_path}, or another tuner "
                         f"format's (this one's: {run['tuner']}): re-tune it whole")
    counts = sorted({int(t) for by_count in timings["measured_us"].values() for t in by_count})
    if counts != sorted(tokens):
        raise ValueError(f"--tokens: {table_path} was tuned at {','.join(map(str, counts))}: "
                         "re-tune its variants at the same counts")
    return dict(timings, **base)


def retuned(old: dict, run: dict) -> dict:
    """The table `old` (with its timings gathered back: read_timings) with the variants a
    run over some of them (`run`) tuned replaced by that run's choices and timings, the run
    recorded under "retuned"."""
    out = dict(old)  # base_of: of this tuner format
    out["retuned"] = [*old.get("retuned", ()),
                      {"command": run["command"], "date": run["date"], "torch": run["torch"],
                       "variants": sorted(run["choices"])}]
    for key in ("choices", "builds", "measured_us"):
        out[key] = {**old.get(key, {}), **run[key]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="h200", help="writes tuning/<name>.json")
    ap.add_argument("--out", default=str(TUNED), help="writes <name>.json there")
    ap.add_argument("--results", default=None,
                    help="writes <name>_tune.jsonl there (default: benchmarks/results, or --out where given)")
    # 512, 2048 and 4096 besides bench.py's counts: where SHUFFLE's V loop starts to pay
    # for prefills (between 128 and 1024 tokens for FP8 at four kv heads, 4096 at one).
    ap.add_argument("--tokens", default="1,16,128,512,1024,2048,4096,8192,32768,65536")
    ap.add_argument("--all", action="store_true", help="every listed variant, not only the benchmark's")
    ap.add_argument("--filter", action="append", default=[], metavar="GLOB",
                    help="only the variants whose name matches (repeatable); re-tunes them within <name>.json")
    ap.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                    help="not the variants whose name matches (repeatable); as --filter, re-tunes the rest")
    ap.add_argument("--resume", action="store_true", help="take the counts <name>.json.partial holds")
    # A launch's time moved 3-4% between one timing and the next in session 22 (PERF.md),
    # enough to pass the 2% rule: those that could win by that much are timed twice.
    ap.add_argument("--confirm-within", type=float, default=CONFIRM_WITHIN,
                    help="time again the launches whose worst slowdown is within this fraction of the "
                         "best's (and the default), keeping each one's faster time; 0: once")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop before a count that would end past this many seconds; resume with --resume")
    args = ap.parse_args()
    start = time.monotonic()
    if args.all:
        variants = list(spec().variants)
    else:
        variants = sorted({find_variant(axes, nkv) for axes in CONFIGS.values() for nkv in (1, 4)},
                          key=lambda v: v.uri)
    if args.filter or args.exclude:
        variants = select(variants, args.filter, args.exclude)
        if not variants:
            ap.error("--filter/--exclude: no variant left to tune")
    tokens = sorted(map(int, args.tokens.split(",")))
    if len(set(tokens)) != len(tokens) or tokens[0] < 1:
        ap.error(f"--tokens: expected distinct positive counts, got {args.tokens}")
    if not args.confirm_within >= 0:
        ap.error(f"--confirm-within: expected a fraction >= 0, got {args.confirm_within:g}")
    tc = toolchain.default()
    jobs = [build.Job(v.uri, source_of(v)) for v in variants]
    build.build_many(jobs, tc)
    table = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "abi": LAUNCH_ABI,
             "tuner": TUNER_FORMAT,
             "command": f"python benchmarks/tune.py --name {args.name} --tokens {args.tokens}"
                        + f" --confirm-within {args.confirm_within:g}" + (" --all" if args.all else "")
                        + "".join(f" --filter '{g}'" for g in args.filter)
                        + "".join(f" --exclude '{g}'" for g in args.exclude),
             "date": time.strftime("%Y-%m-%d", time.gmtime()),
             "timings": f"benchmarks/results/{args.name}_tune.jsonl",
             "builds": {job.uri: build.cache_key(job.source, tc) for job in jobs},
             "choices": {}, "measured_us": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else RESULTS if out.resolve() == TUNED.resolve() else out
    results.mkdir(parents=True, exist_ok=True)
    partial = out / f"{args.name}.json.partial"
    base = None  # the table a run with --filter/--exclude re-tunes within
    if args.filter or args.exclude:
        try:
            base = base_of(out / f"{args.name}.json", results / f"{args.name}_tune.jsonl", table, tokens)
        except ValueError as e:
            ap.error(str(e))
    if partial.exists() and not args.resume:
        ap.error(f"{partial} holds a run cut short: pass --resume to continue it, or remove it")
    if args.resume and partial.exists():
        done = json.loads(partial.read_text())
        if any(done.get(k) != table[k] for k in ("device", "torch", "abi", "tuner", "command")):
            ap.error(f"--resume: {partial} was made by another command, device, torch or tuner; remove it")
        table["date"] = done.get("date", table["date"])  # the day the run began
        kept = [uri for uri in done["measured_us"] if done["builds"].get(uri) == table["builds"].get(uri)]
        for uri in kept:
            table["measured_us"][uri] = done["measured_us"][uri]
            if uri in done["choices"]:
                table["choices"][uri] = done["choices"][uri]
        changed = len(done["measured_us"]) - len(kept)
        print(f"resuming: {sum(uri in table['choices'] for uri in kept)} variants and "
              f"{sum(len(table['measured_us'][uri]) for uri in kept if uri not in table['choices'])} counts "
              f"of others from {partial}" + (f" ({changed} variants re-timed: their builds changed)" if changed else ""),
              flush=True)
    # The most seconds a launch took at a count and TPs so far: --budget-s's estimate.
    s_per_launch: dict[tuple, float] = {}
    for v in variants:
        if v.uri in table["choices"]:
            continue
        measured = table["measured_us"].setdefault(v.uri, {})
        for t in tokens:
            if str(t) in measured:
                continue
            began, seen = time.monotonic(), (t, tuple(tps(v)))
            estimate = s_per_launch.get(seen, 0.0) * launches_per_count(v)
            if args.budget_s is not None and began - start + estimate > args.budget_s:
                print(f"stopping within --budget-s {args.budget_s:g} before {v.uri} T={t}; {partial} holds "
                      "what was measured: continue with --resume", flush=True)
                return 3
            with hang_watchdog():
                measured[str(t)] = measure_count(v, t, args.confirm_within)
            build.write_if_different(partial, json.dumps(table, indent=1, sort_keys=True) + "\n")
            s_per_launch[seen] = max(s_per_launch.get(seen, 0.0), (time.monotonic() - began) / launches_per_count(v))
            chosen = pick(v, t, measured[str(t)])
            for name, times in measured[str(t)].items():
                print(f"{v.uri} T={t} {name}: " + "  ".join(f"{key} {us:.2f} us" for key, us in times.items()))
            print(f"{v.uri} T={t} -> depth {chosen.depth} tile {chosen.tile} v_loop {chosen.v_loop} "
                  f"lanes {chosen.lanes} groups {chosen.groups}", flush=True)
        table["choices"][v.uri] = ranges([(t, pick(v, t, measured[str(t)])) for t in tokens])
        build.write_if_different(partial, json.dumps(table, indent=1, sort_keys=True) + "\n")
    if base is not None:
        table = retuned(base, table)
    text = table_text(table)
    parse(json.loads(text), "tuner output")  # what the runtime will accept
    build.write_if_different(results / f"{args.name}_tune.jsonl", timings_text(table))
    build.write_if_different(out / f"{args.name}.json", text)
    partial.unlink(missing_ok=True)
    print(f"wrote {out / (args.name + '.json')} and {results / (args.name + '_tune.jsonl')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
