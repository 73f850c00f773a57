"""benchmarks/results/*.json → BENCHMARKS.md tables and each run's GB/s plot, and the summary of
h200.json in benchmarks/PERF.md.

`python benchmarks/report.py` regenerates BENCHMARKS.md and PERF.md's figures from the
results in the repo; bench.py calls `write_report` after every configuration it measures.
`h200.json` is the full sweep on the GPU of record; any other result file is a further run,
shown with its own command, copy bandwidth and plot (`<run>_gbps.png`), since figures are only
compared within one run.
(`*_tune.jsonl` there are the tuner's timings, benchmarks/tune.py, not bench runs.)
In PERF.md only the block between PERF_BEGIN and PERF_END is generated (`write_perf`);
the rest is written by hand.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _fmt(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def copy_pct(r: dict) -> float | None:
    """The same-bytes copy's % of the 2 GiB copy in the case's run (None where it was not
    timed): what a kernel that only moves the case's bytes reaches at that size."""
    s = r.get("copy_same_bytes_us")
    return r["pct_copy"] * r["us"] / s if s else None


def _pct(r: dict) -> str:
    c = copy_pct(r)
    return f"{r['pct_copy']:.1f}%" + ("" if c is None else f" (same-bytes copy {c:.1f}%)")


def _us(r: dict) -> str:
    return f"{r['us']:.2f} µs"


def _times(peer: str):
    return lambda r: f"{r[peer] / r['us']:.1f}×" if r.get(peer) else "–"


# Issue 3's "done when", case by case: (target, the cases it covers, whether a case meets
# it, the case's figure). A peer not timed in a case (–) counts as missed.
TARGETS = (
    ("≥ 8192 tokens: ≥ 85% of the copy", lambda r: r["tokens"] >= 8192, lambda r: r["pct_copy"] >= 85, _pct),
    ("1024 tokens, TP1: ≥ 75% of the copy", lambda r: r["tokens"] == 1024 and r["tp"] == 1,
     lambda r: r["pct_copy"] >= 75, _pct),
    ("1024 tokens, TP8: ≥ 40% of the copy", lambda r: r["tokens"] == 1024 and r["tp"] == 8,
     lambda r: r["pct_copy"] >= 40, _pct),
    ("≤ 16 tokens: ≤ 2.0 µs", lambda r: r["tokens"] <= 16, lambda r: r["us"] <= 2.0, _us),
    ("128 tokens, TP1: ≤ 3.5 µs", lambda r: r["tokens"] == 128 and r["tp"] == 1, lambda r: r["us"] <= 3.5, _us),
    ("128 tokens, TP8: ≤ 2.5 µs", lambda r: r["tokens"] == 128 and r["tp"] == 8, lambda r: r["us"] <= 2.5, _us),
    ("≥ 1024 tokens: ≥ 3× `torch.compile`", lambda r: r["tokens"] >= 1024,
     lambda r: bool(r.get("compile_us")) and r["compile_us"] >= 3 * r["us"], _times("compile_us")),
    ("≥ 1024 tokens: ≥ 15× eager", lambda r: r["tokens"] >= 1024,
     lambda r: bool(r.get("eager_us")) and r["eager_us"] >= 15 * r["us"], _times("eager_us")),
)
HOST_TARGET_US = 15.0


def of_same_bytes(r: dict) -> float | None:
    """The case's % of its same-bytes copy (that copy's µs / the op's)."""
    s = r.get("copy_same_bytes_us")
    return 100 * s / r["us"] if s else None


# Issue 37's targets, each comparing a configuration's case with another's of the same TP
# and tokens in the run: (target, configuration, the one it is held to, whether it meets it,
# the figures shown for a miss).
BF16, FP8, PER_TOKEN = "vllm_shuffle16 bf16", "vllm_shuffle16 fp8", "vllm_shuffle16 fp8 per-token"
FP8_Q = "vllm_shuffle16 bf16 + fp8 q"
PAIR_TARGETS = (
    ("per-token FP8 within 5% of per-tensor FP8 (µs)", PER_TOKEN, FP8,
     lambda r, o: r["us"] <= 1.05 * o["us"], lambda r, o: f"{r['us']:.2f} vs {o['us']:.2f} µs"),
    *((f"{name} within 5 points of bf16 SHUFFLE (% of the same-bytes copy)", name, BF16,
       lambda r, o: of_same_bytes(r) is not None and of_same_bytes(o) is not None
       and of_same_bytes(r) >= of_same_bytes(o) - 5,
       lambda r, o: f"{_fmt(of_same_bytes(r))}% vs {_fmt(of_same_bytes(o))}%") for name in (FP8, PER_TOKEN, FP8_Q)),
)


def _pair_targets(recs: list) -> list[tuple[str, int, int, list[str]]]:
    """(target, cases met, cases, misses) of PAIR_TARGETS over the run's records."""
    by = {(r["config"], r["tp"], r["tokens"]): r for r in recs}
    out = []
    for target, name, other, meets, figure in PAIR_TARGETS:
        cases = [(r, by[(other, r["tp"], r["tokens"])]) for r in recs
                 if r["config"] == name and (other, r["tp"], r["tokens"]) in by]
        if cases:
            missed = [f"TP{r['tp']} {r['tokens']}: {figure(r, o)}" for r, o in cases if not meets(r, o)]
            out.append((target, len(cases) - len(missed), len(cases), missed))
    return out


def _targets(result: dict) -> list[str]:
    lines = ["### Targets (issues 3 and 37) in this run", "", "| target | cases met | missed |", "|---|---:|---|"]
    for target, covers, meets, figure in TARGETS:
        cases = [r for r in result["records"] if covers(r)]
        if not cases or all(figure(r) == "–" for r in cases):  # none, or a peer the run did not time
            continue
        missed = [f"{r['config']} TP{r['tp']} {r['tokens']}: {figure(r)}" for r in cases if not meets(r)]
        lines.append(f"| {target} | {len(cases) - len(missed)} of {len(cases)} | {'; '.join(missed) or '–'} |")
    for target, met, n, missed in _pair_targets(result["records"]):
        lines.append(f"| {target} | {met} of {n} | {'; '.join(missed) or '–'} |")
    host = result["host_overhead_us"]
    lines += [f"| host overhead per eager call: ≤ {HOST_TARGET_US:g} µs | {int(host <= HOST_TARGET_US)} of 1 | "
              f"{'–' if host <= HOST_TARGET_US else f'{host:.1f} µs'} |", "",
              "A case missing a % target shows beside its figure the same-bytes copy's own % of the "
              "copy at its size in this run: a target above that figure asks the op to outrun a "
              "kernel that only moves its bytes.", ""]
    return lines


def plot_name(run: str) -> str:
    """The file beside results/<run>.json that holds its GB/s plot."""
    return f"{run}_gbps.png"


def _run_section(name: str, result: dict) -> list[str]:
    lines = [
        f"## Run `{name}.json`",
        "",
        f"![achieved GB/s](benchmarks/results/{plot_name(name)})",
        "",
        f"- command: `{result['command']}`",
        f"- GPU: {result['gpu']}, torch {result['torch']}",
        f"- copy roofline (2 GiB device-to-device, read + write, same run): **{result['copy_gbps']:.0f} GB/s**",
        f"- timing: {result['timing']}",
        "- bytes: qkv read once + q_out, index_q_out, K, V, index-cache writes + positions/slots",
        "- same-bytes copy: a plain copy kernel (`benchmarks/copy.hip`, a 16-byte vector per "
        "thread, launched as the op is) reading half the case's bytes and writing the other "
        "half, rotating as many buffers, timed the same way; % of it = its µs / ours: how close "
        "a case is to what moving its bytes costs at that size",
        "- depth, tile, lanes, V, K/V groups: the main loop's pipeline depth, its tokens per tile "
        "(times lanes), its head lanes per thread, where a transposed V is written (the V loop or "
        "the main loop; – where V is not transposed), and the groups of threads a K/V head's "
        "tokens are dealt to in a call of several passes (– where K/V have no per-token scales), "
        "as the runtime picked them from `tuning/` (made by `benchmarks/tune.py`)",
        *([f"- launch floor (a one-element torch `add_` timed the same way, no dependent launch): "
           f"**{result['launch_floor_us']:.2f} µs** per call"] if "launch_floor_us" in result else []),
        f"- host overhead per eager call: **{result['host_overhead_us']:.1f} µs** "
        f"(signature table: {result['host_dispatch']}; torch's one-element `add_` on this CPU: "
        f"{result['host_torch_add_us']:.1f} µs)",
        f"- build ({result['build']['compiler']}): cold {result['build']['cold_build_s']:.2f} s per variant "
        f"(max {result['build']['cold_build_s_max']:.2f} s over {result['build']['variants']}), "
        f"warm load {result['build']['warm_load_ms']:.2f} ms",
        "",
    ]
    errors = sorted({r[k] for r in result["records"] for k in r if k.endswith("_error")})
    for e in errors:
        lines += [f"- a peer failed here (its column shows –): `{e[:200]}`"]
    if errors:
        lines.append("")
    lines += _targets(result)
    recs = result["records"]
    for config in dict.fromkeys(r["config"] for r in recs):
        lines += [f"### {config}", "",
                  "| TP | tokens | slots | depth | tile | lanes | V | K/V groups | µs (graph) | µs (event, 1 call) "
                  "| GB/s | % copy | same-bytes copy µs | % of it | eager µs | compile µs | × eager | × compile |",
                  "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in recs if r["config"] == config):
            e, c, s = r.get("eager_us"), r.get("compile_us"), r.get("copy_same_bytes_us")
            lines.append(
                f"| {r['tp']} | {r['tokens']} | {r['slots']} | {r['pipeline_depth']} | {r['tokens_per_tile']} | "
                # records from before ABI 7 ran one lane per thread; from before launch ABI 8,
                # per-token K/V heads in two groups
                f"{r.get('lanes_per_thread', 1)} | {r.get('v_written') or '–'} | "
                f"{r.get('kv_groups', 2 if r['kv'] == 'per_token_head' else None) or '–'} | "
                f"{r['us']:.2f} | {r['us_event_per_call']:.1f} | "
                f"{r['gbps']:.0f} | {r['pct_copy']:.1f} | {_fmt(s, '.2f')} | {_fmt(100 * s / r['us'] if s else None)} | "
                f"{_fmt(e)} | {_fmt(c)} | "
                f"{_fmt(e / r['us'] if e else None)} | {_fmt(c / r['us'] if c else None)} |")
        lines.append("")
    return lines


def _plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    recs = result["records"]
    configs = list(dict.fromkeys(r["config"] for r in recs))
    fig, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs), 3.6), sharey=True, squeeze=False)
    for ax, config in zip(axes[0], configs):
        for tp in sorted({r["tp"] for r in recs}):
            pts = sorted((r["tokens"], r["gbps"]) for r in recs if r["config"] == config and r["tp"] == tp)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"TP{tp}")
        ax.axhline(result["copy_gbps"], color="k", ls="--", lw=1, label="D2D copy")
        ax.set_xscale("log", base=2)
        ax.set_title(config, fontsize=10)
        ax.set_xlabel("tokens per call")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("achieved GB/s")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PERF_BEGIN = "<!-- figures: generated by benchmarks/report.py from benchmarks/results/h200.json; do not edit -->"
PERF_END = "<!-- end figures -->"
# PERF.md's columns: the small calls' µs, then the op's % of the copy at these counts
# (each a column; a range over the counts of the last), and the peers over LARGE tokens.
SMALL = (1, 16, 128)
PCT_COLUMNS = ((1024,), (8192,), (32768, 65536))
LARGE = 1024


def _range(values: list, spec: str, unit: str = "") -> str:
    """'lo–hi' of the values as `spec` writes them, one figure where those are equal."""
    lo, hi = (format(x, spec) for x in (min(values), max(values)))
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def perf_figures(name: str, result: dict) -> list[str]:
    """The lines of PERF.md's generated block: the run, a row per contract and TP, the targets."""
    recs = result["records"]
    lines = [f"Run `{name}.json` (`{result['command']}`): {result['gpu']}, torch {result['torch']}; "
             f"2 GiB copy **{result['copy_gbps']:.0f} GB/s**"
             + (f", launch floor {result['launch_floor_us']:.2f} µs" if "launch_floor_us" in result else "")
             + f", host {result['host_overhead_us']:.1f} µs per eager call.", "",
             "µs of the small calls; at larger counts the op's % of the 2 GiB copy, and in parentheses "
             "its % of the same-bytes copy (that copy's µs / the op's); the fewest times faster than "
             f"each peer over ≥ {LARGE} tokens. All from BENCHMARKS.md's tables.", "",
             "| contract | TP | µs at " + " / ".join(map(str, SMALL)) + " tokens | "
             + " | ".join("–".join(map(str, c)) + " tokens" for c in PCT_COLUMNS) + " | × eager | × compile |",
             "|---|---:|---|" + "---|" * len(PCT_COLUMNS) + "---:|---:|"]
    for config in dict.fromkeys(r["config"] for r in recs):
        for tp in sorted({r["tp"] for r in recs if r["config"] == config}):
            case = {r["tokens"]: r for r in recs if r["config"] == config and r["tp"] == tp}
            small = " / ".join(_fmt(case[t]["us"] if t in case else None, ".2f") for t in SMALL)
            cells = []
            for counts in PCT_COLUMNS:
                rs = [case[t] for t in counts if t in case]
                of_copy = [100 * r["copy_same_bytes_us"] / r["us"] for r in rs if r.get("copy_same_bytes_us")]
                cells.append("–" if not rs else _range([r["pct_copy"] for r in rs], ".1f", "%")
                             + (f" ({_range(of_copy, '.0f', '%')})" if of_copy else ""))
            peers = [_fmt(min(ratios), ".1f") + "×" if (ratios := [r[p] / r["us"] for t, r in case.items()
                                                                     if t >= LARGE and r.get(p)]) else "–"
                     for p in ("eager_us", "compile_us")]
            lines.append(f"| {config} | {tp} | {small} | " + " | ".join(cells) + " | " + " | ".join(peers) + " |")
    lines += ["", "Issues 3's and 37's targets in this run (BENCHMARKS.md names the misses):", ""]
    for target, covers, meets, _ in TARGETS:
        cases = [r for r in recs if covers(r)]
        if cases:
            lines.append(f"- {target}: {sum(map(meets, cases))} of {len(cases)}")
    for target, met, n, _ in _pair_targets(recs):
        lines.append(f"- {target}: {met} of {n}")
    host = result["host_overhead_us"]
    lines.append(f"- host overhead per eager call: ≤ {HOST_TARGET_US:g} µs: {int(host <= HOST_TARGET_US)} of 1")
    return lines


def write_perf(results_dir: Path, perf_path: Path, name: str = "h200") -> None:
    """Rewrite PERF.md's block between PERF_BEGIN and PERF_END from results/<name>.json; the
    text around it is kept as it is."""
    text = perf_path.read_text()
    head, sep, rest = text.partition(PERF_BEGIN + "\n")
    _, sep2, tail = rest.partition(PERF_END)
    if not sep or not sep2:
        raise ValueError(f"{perf_path}: expected a line {PERF_BEGIN!r} and later {PERF_END!r}")
    result = json.loads((results_dir / f"{name}.json").read_text())
    perf_path.write_text(head + sep + "\n".join(perf_figures(name, result)) + "\n" + sep2 + tail)


def write_report(results_dir: Path, md_path: Path) -> None:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))}
    order = sorted(runs, key=lambda n: (n != "h200", n))
    # Titled by the GPUs its runs were made on: a run elsewhere than the H200 of record
    # must not read as one of it.
    lines = [f"# Benchmarks ({', '.join(sorted({r['gpu'] for r in runs.values()}))})", "",
             "Generated by `benchmarks/report.py` from `benchmarks/results/*.json` (written by "
             "`benchmarks/bench.py` on the device); do not edit by hand. Ratios compare figures "
             "of one run only.", ""]
    for name in order:
        _plot(runs[name], results_dir / plot_name(name))
        lines += _run_section(name, runs[name])
    md_path.write_text("\n".join(lines))


if __name__ == "__main__":
    write_report(RESULTS, RESULTS.parent.parent / "BENCHMARKS.md")
    write_perf(RESULTS, RESULTS.parent / "PERF.md")
