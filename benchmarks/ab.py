"""A/B timing of kernel builds that differ by preprocessor definitions or kernel tree, on one GPU.

    python benchmarks/ab.py --sets "base=;moved=KVF_X=1,KVF_Y" --cases m3:1:1024,fp8:8:8192:1:4:1:2
                            [--rounds 3] [--out results.json]

For trying a change to the kernel header behind a macro before it is made for good: each
set names a build (`name=` and its definitions, comma-separated; the first set is the
baseline), each case a configuration of bench.py (m3, sglang, shuffle, fp8, fp8t: per-token
FP8, shuffleq: bf16 with the FP8 query output; a trailing j: with GPT-J rotary), a TP and a
token count, and optionally a launch (depth:tile:v_loop:lanes[:groups]; default: the tuned one).
Every build's launch of a case is checked against the reference (except a set named in
--unchecked: an ablation, which drops work on purpose), then timed as bench.py times the
op (CUDA-graph replay, inputs rotated past L2), the sets in turn and in reverse
order on alternate rounds; a case's line gives each set's fastest time and its change from
the baseline's. Nothing is written to the tuning table or the benchmark results.

A set `name=@DIR[:DEFINES]` builds the kernel of another checkout of this repository at
DIR (from the current directory; no ':' in it): its headers (DIR/include) and its checked-in
source of each case's variant (DIR/generated/<uri>.hip), with DEFINES if given. Everything
else is this checkout's: the variants and inputs, the reference check, the launches and the
runtime, whose ABI the libraries must have (one that fails its load check is named with its
set and variant before any timing). So a change that rewrites the kernel is judged against
the commit before it in one run:

    mkdir -p .device/old && git archive HEAD~1 | tar -x -C .device/old
    python benchmarks/ab.py --sets "old=@.device/old;new=" --cases m3:1:1024,fp8:8:8192

A case whose variant DIR lacks (a variant new since that commit) is refused before any
build, naming the set, the case and the variant.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench import CONFIGS, GPTJ_CONFIGS, TP, find_variant, graph_us, hang_watchdog, input_sets  # noqa: E402
from kvforge.codegen.model import Variant  # noqa: E402
from kvforge.runtime import build, toolchain  # noqa: E402
from kvforge.runtime.api import launch_with  # noqa: E402
from kvforge.runtime.registry import REGISTRY, MissingSourceError, source_of  # noqa: E402
from kvforge.runtime.testing import ReferenceCheck  # noqa: E402
from kvforge.runtime.tuning import Launch, launch_used  # noqa: E402

_NEOX_NAMES = {"m3": "vllm_m3 bf16", "sglang": "sglang_nhd bf16", "shuffle": "vllm_shuffle16 bf16",
               "fp8": "vllm_shuffle16 fp8", "fp8t": "vllm_shuffle16 fp8 per-token",
               "shuffleq": "vllm_shuffle16 bf16 + fp8 q"}
# A trailing j: the configuration with GPT-J rotary (bench.GPTJ_CONFIGS), e.g. m3j.
CONFIG_NAMES = {**_NEOX_NAMES, **{f"{short}j": f"{name} gptj" for short, name in _NEOX_NAMES.items()}}
_CONFIG_AXES = {**CONFIGS, **GPTJ_CONFIGS}
_DEFINE = re.compile(r"[A-Za-z_]\w*(=\S*)?")


class Case(NamedTuple):
    config: str                # a key of bench.CONFIGS or bench.GPTJ_CONFIGS
    tp: int
    tokens: int
    launch: Optional[Launch]   # None: the tuned launch


@dataclasses.dataclass(frozen=True)
class BuildSet:
    """One build of the kernel: extra definitions, and the checkout whose kernel it is."""

    defines: tuple[str, ...] = ()
    tree: str = ""  # DIR of `@DIR` (as given); "": this checkout's kernel

    def toolchain_from(self, base: toolchain.Toolchain) -> toolchain.Toolchain:
        """`base` with these definitions added, on DIR (ToolchainError if it is no checkout)."""
        tc = dataclasses.replace(base, defines=base.defines + self.defines)
        return toolchain.on_tree(tc, self.tree) if self.tree else tc


def parse_sets(text: str) -> dict[str, BuildSet]:
    """"base=;moved=KVF_X=1,KVF_Y;old=@../old:KVF_Z" -> {"base": BuildSet(),
    "moved": BuildSet(("KVF_X=1", "KVF_Y")), "old": BuildSet(("KVF_Z",), "../old")}."""
    sets: dict[str, BuildSet] = {}
    for item in text.split(";"):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ValueError(f"--sets: expected name=DEFINES or name=@DIR[:DEFINES], got {item!r}")
        if name in sets:
            raise ValueError(f"--sets: {name!r} named twice")
        tree, defines = "", value
        if value.startswith("@"):
            tree, _, defines = value[1:].partition(":")
            if not tree.strip():
                raise ValueError(f"--sets: {name}: expected @DIR[:DEFINES], got {value!r}")
        found = tuple(d for d in defines.split(",") if d)
        bad = [d for d in found if not _DEFINE.fullmatch(d)]
        if bad:
            raise ValueError(f"--sets: {name}: expected NAME or NAME=VALUE definitions, got {bad}")
        sets[name] = BuildSet(found, tree.strip())
    return sets


def parse_case(text: str) -> Case:
    """"m3:1:1024", "fp8:8:8192:1:4:1:2" (depth:tile:v_loop:lanes) or "fp8t:8:65536:1:4:2:2:4"
    (and K/V groups)."""
    fields = text.split(":")
    if len(fields) not in (3, 7, 8):
        raise ValueError(f"--cases: expected config:tp:tokens[:depth:tile:v_loop:lanes[:groups]], got {text!r}")
    if fields[0] not in CONFIG_NAMES:
        raise ValueError(f"--cases: {text}: config {fields[0]!r} is not one of {', '.join(CONFIG_NAMES)}")
    try:
        tp, tokens, *launch = map(int, fields[1:])
    except ValueError:
        raise ValueError(f"--cases: {text}: expected integers after the config") from None
    if tp not in TP:
        raise ValueError(f"--cases: {text}: TP {tp} is not one of {sorted(TP)}")
    if tokens < 1:
        raise ValueError(f"--cases: {text}: expected at least one token, got {tokens}")
    chosen = Launch(*launch) if launch else None
    if chosen and chosen.problems():
        raise ValueError(f"--cases: {text}: {'; '.join(chosen.problems())}")
    return Case(CONFIG_NAMES[fields[0]], tp, tokens, chosen)


def set_jobs(name: str, tc: toolchain.Toolchain, variants: dict[str, Variant]) -> list[build.Job]:
    """The builds a set needs: each case's variant (`variants`: by case) once, from the set's
    tree; MissingSourceError naming the set and the case for a variant the tree lacks."""
    jobs: dict[Variant, build.Job] = {}
    for text, v in variants.items():
        if v not in jobs:
            try:
                jobs[v] = build.Job(v.uri, source_of(v, tc))
            except MissingSourceError as e:
                raise MissingSourceError(f"{name}: case {text}: {e}") from None
    return list(jobs.values())


def run_case(case: Case, toolchains: dict[str, toolchain.Toolchain], rounds: int,
             unchecked: frozenset = frozenset()) -> dict[str, list[float]]:
    """µs per call of each set's build, one timing per round."""
    nq, nkv, niq = TP[case.tp]
    v = find_variant(_CONFIG_AXES[case.config], nkv)
    launch = case.launch or launch_used(torch.cuda.get_device_name(), v, case.tokens)
    sets, _, _, n_calls = input_sets(v, case.tokens, nq, niq)
    check = ReferenceCheck(sets[0], ref_device="cuda")
    calls = {}
    for name, tc in toolchains.items():
        if name not in unchecked:
            check(lambda **a: launch_with(launch, tc, **a)())
        fns = [launch_with(launch, tc, **s) for s in sets]
        calls[name] = [fns[i % len(fns)] for i in range(n_calls)]
    times: dict[str, list[float]] = {name: [] for name in toolchains}
    for r in range(rounds):
        for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            times[name].append(graph_us(calls[name]))
    del sets, check, calls
    torch.cuda.empty_cache()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", required=True,
                    help='builds: "name=DEF,DEF;name2=@DIR[:DEF,...];..." (the first: the baseline)')
    ap.add_argument("--cases", required=True, help="config:tp:tokens[:depth:tile:v_loop:lanes[:groups]],...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="", help="where the times go as JSON (none: printed only)")
    ap.add_argument("--unchecked", default="",
                    help="sets timed without the reference check: ablations, which drop work on purpose")
    args = ap.parse_args()
    try:
        sets = parse_sets(args.sets)
        cases = {text: parse_case(text) for text in args.cases.split(",")}
    except ValueError as e:
        ap.error(str(e))
    unchecked = frozenset(x for x in args.unchecked.split(",") if x)
    if unchecked - set(sets):
        ap.error(f"--unchecked: {', '.join(sorted(unchecked - set(sets)))}: not a set of --sets")
    if args.rounds < 1:
        ap.error(f"--rounds: expected at least 1, got {args.rounds}")
    base = toolchain.default()
    variants = {text: find_variant(_CONFIG_AXES[c.config], TP[c.tp][1]) for text, c in cases.items()}
    try:  # every set's sources first: a checkout or a variant a tree lacks, before any build
        toolchains = {name: s.toolchain_from(base) for name, s in sets.items()}
        jobs = {name: set_jobs(name, tc, variants) for name, tc in toolchains.items()}
    except (toolchain.ToolchainError, MissingSourceError) as e:
        ap.error(f"--sets: {e}")
    for name, tc in toolchains.items():
        build.build_many(jobs[name], tc)
        for v in set(variants.values()):  # loaded now, so a library of another ABI is named here
            try:
                REGISTRY.get(v, tc)
            except OSError as e:
                print(f"ab.py: set {name} ({sets[name].tree or 'this checkout'}): variant {v.uri}: its "
                      f"library does not load with this checkout's runtime: {e}", file=sys.stderr)
                return 1
    first = next(iter(sets))
    results = {}
    for text, case in cases.items():
        with hang_watchdog():
            times = results[text] = run_case(case, toolchains, args.rounds, unchecked)
        best = {name: min(t) for name, t in times.items()}
        print(f"{text:22s} " + "  ".join(f"{name} {us:8.2f} us ({us / best[first] - 1:+.1%})"
                                         for name, us in best.items()), flush=True)
        if args.out:  # after every case, so a run cut short keeps what it measured
            record = {"sets": {name: dataclasses.asdict(s) for name, s in sets.items()}, "times_us": results}
            Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
