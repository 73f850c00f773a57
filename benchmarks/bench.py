"""H200 benchmark of the fused op against the unfused torch path (SPEC §5, §8).

    python benchmarks/bench.py [--name h200] [--peers eager,compile] [--tokens ...] [--tp ...]

In one run on one GPU: a 2 GiB device-to-device copy (read + write) as the roofline;
every case of MiniMax-M3 TP1/TP4/TP8 × tokens × {vllm_shuffle16 bf16, vllm_shuffle16 FP8,
sglang_nhd bf16, vllm_m3 bf16, vllm_shuffle16 FP8 with per-token scales, vllm_shuffle16 bf16
with the FP8 query output}, each checked against the reference first, then timed as
GPU time per call under CUDA-graph replay of many back-to-back calls (median of several
replays), rotating input sets so the working set is several times the 60 MB L2; the peers
on the same inputs the same way, and a copy of the same bytes (the cost of moving them at
that size, without the op's math and dependent reads). Writes benchmarks/results/<name>.json
and regenerates BENCHMARKS.md and the plot (benchmarks/report.py).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.unfused import layouts, unfused  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from kvforge.codegen.model import IndexMode  # noqa: E402
from kvforge.runtime import build, dispatch, fused_qknorm_rope_cache, toolchain, tuning  # noqa: E402
from kvforge.runtime.abi import V_LOOP_OFF, V_LOOP_ON, KernelLibrary  # noqa: E402
from kvforge.runtime.registry import source_of, spec  # noqa: E402
from kvforge.runtime.testing import check_against_reference, make_inputs, with_outputs  # noqa: E402

TP = {1: (64, 4, 4), 4: (16, 1, 1), 8: (8, 1, 1)}  # (q heads, kv heads, index heads)
TOKENS = [1, 16, 128, 1024, 8192, 32768, 65536]
DECODE_UP_TO = 256  # calls of up to this many tokens are timed as decodes (a slot per page)
CONFIGS = {  # name -> variant axes (TP sets num_kv_heads)
    "vllm_shuffle16 bf16": dict(contract="vllm_shuffle16", index_dtype="model", kv_scale="none"),
    "vllm_shuffle16 fp8": dict(contract="vllm_shuffle16", index_dtype="fp8", kv_scale="per_tensor",
                               fp8="e4m3fn"),
    "sglang_nhd bf16": dict(contract="sglang_nhd", index_dtype="model", kv_scale="none", cos_sin="fp32"),
    "vllm_m3 bf16": dict(contract="vllm_m3", index_dtype="model", kv_scale="none"),
    # AITER's per-token scales (beside per-tensor FP8: issue 37 asks for it within 5%), and
    # vLLM's FP8 query output beside q_out.
    "vllm_shuffle16 fp8 per-token": dict(contract="vllm_shuffle16", index_dtype="fp8", kv_scale="per_token_head",
                                         fp8="e4m3fn"),
    "vllm_shuffle16 bf16 + fp8 q": dict(contract="vllm_shuffle16", index_dtype="model", kv_scale="none",
                                        q_fp8="per_tensor", fp8="e4m3fn"),
}
# The same configurations with GPT-J rotary (benchmarks/ab.py compares them with NeoX's).
GPTJ_CONFIGS = {f"{name} gptj": {**axes, "rope": "gptj"} for name, axes in CONFIGS.items()}
L2_BYTES = 60 * 2 ** 20


def find_variant(axes: dict, nkv: int):
    want = {"dtype": "bf16", "head_dim": "128", "rotary_dim": "64", "norm": "gemma", "rope": "neox",
            "index_mode": "full", "cos_sin": "bf16", "num_kv_heads": str(nkv), **axes}
    later = ("kv_page_size", "index_page_size", "q_fp8")  # spelled only where not the default
    for v in spec().variants:
        axes = v.axes()
        if all(axes.get(k) == str(x) for k, x in want.items()) and all(k in want for k in later if k in axes):
            return v
    raise KeyError(want)


def op_bytes(v, args: dict) -> int:
    """The fewest bytes the op must move (SPEC §8)."""
    T = args["qkv"].shape[0]
    nq, niq, nkv, D = args["num_heads"], args["num_index_heads"], v.num_kv_heads, v.head_dim
    kv_e = 1 if v.kv_fp8 else 2
    idx_e = 1 if v.index_fp8 else 2
    full = v.index_mode is IndexMode.FULL
    n = args["qkv"].numel() * 2 + T * nq * D * 2 + 2 * T * nkv * D * kv_e + T * 8 * 2
    if v.kv_scale.dynamic:
        n += 2 * T * nkv * 4  # a K and a V scale per token and kv head
    if args.get("q_fp8_out") is not None:
        n += T * nq * D
    if full:
        n += T * niq * D * idx_e + T * D * idx_e + T * 8
    return n


def events_ms(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def copy_bandwidth(nbytes: int = 2 * 2 ** 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(events_ms(lambda: dst.copy_(src), 20))
    return 2 * nbytes / ms / 1e6  # GB/s, read + write


# A case (bench.py, ab.py) or token count (tune.py) takes under a minute; a kernel that
# never returns (an aligned barrier some threads reach at another instruction hung the
# GPU tests and the tuner, PERF.md session 25) would hold the device call to its limit.
HANG_S = 300.0


@contextlib.contextmanager
def hang_watchdog(seconds: float = HANG_S):
    """Ends the process (exit status 1, every thread's stack on stderr) if the block runs
    longer than `seconds`, so a hung kernel leaves the rest of a device call to the
    commands after it; what was written before (results, a tune's partial file) stays."""
    # The process's own stderr: under pytest's capture sys.stderr has no file descriptor.
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def graph_us(calls: list, reps: int = 7, warmup_ms: float = 100.0) -> float:
    """GPU µs per call: one CUDA graph of `calls` back to back, median over replays.

    Replays for `warmup_ms` before timing: right after the reference check (GBs of
    temporaries allocated and freed), the first ~50 ms of replays ran 8-11% slower at
    65536 tokens than the same graph later (benchmarks/PERF.md, v6.1)."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    first = events_ms(g.replay, 1)[0]
    for _ in range(min(1000, int(warmup_ms / max(first, 1e-3)))):
        g.replay()
    return statistics.median(events_ms(g.replay, reps)) * 1e3 / len(calls)


COPY_SOURCE = ROOT / "benchmarks" / "copy.hip"


@functools.cache
def _copy16():
    """kvf_bench_copy16 of benchmarks/copy.hip, built (and cached) as a variant is."""
    lib = build.build_and_load(build.Job("bench_copy16", COPY_SOURCE.read_text()), toolchain.default(), ctypes.CDLL)
    fn = lib.kvf_bench_copy16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return fn


def copy_same_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """src's bytes into dst by benchmarks/copy.hip, on the current stream (graphs capture it)."""
    if not (src.is_contiguous() and dst.is_contiguous() and src.nbytes == dst.nbytes and src.nbytes % 16 == 0
            and src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0):
        raise ValueError("copy_same_bytes takes two contiguous, 16-byte aligned tensors of the same size, "
                         f"a multiple of 16 bytes; got {src.nbytes} and {dst.nbytes} bytes at "
                         f"{src.data_ptr():#x} and {dst.data_ptr():#x}")
    err = _copy16()(src.data_ptr(), dst.data_ptr(), src.nbytes // 16, torch.cuda.current_stream().cuda_stream)
    if err:
        raise RuntimeError(f"kvf_bench_copy16 failed: error {err}")


def same_bytes_copy_us(nbytes: int, n_sets: int, n_calls: int) -> float:
    """GPU µs per call of a kernel that copies the op's bytes (half read, half written), over
    as many buffers rotated and timed as the op is: what these bytes cost at this size,
    launch and ramp included, with no math and no dependent reads. benchmarks/copy.hip,
    launched as the op is (dependent launches); torch's elementwise add (no dependent
    launch) was 4-5% slower at 46-84 MB, and `copy_` is a memcpy node in a graph, which ran
    at 2.8 TB/s for 1.3 GB on the H200, below the 2 GiB eager copy (benchmarks/PERF.md,
    session 17)."""
    n = max(1, nbytes // 32) * 4  # int32 elements in whole 16-byte vectors: nbytes / 2 read, as many written
    bufs = [(torch.zeros(n, dtype=torch.int32, device="cuda"),
             torch.empty(n, dtype=torch.int32, device="cuda")) for _ in range(n_sets)]
    us = graph_us([functools.partial(copy_same_bytes, *bufs[i % n_sets]) for i in range(n_calls)])
    del bufs
    torch.cuda.empty_cache()
    return us


def launch_floor_us(n_calls: int = 400) -> float:
    """GPU µs per call of a trivial kernel (torch's one-element `add_`) timed as the op
    is: what a launch alone costs in this replay, without a dependent launch (torch has
    none; the same-bytes copy, which has one, takes 0.6-0.8 µs at 1 token)."""
    x = torch.zeros(1, device="cuda")
    return graph_us([functools.partial(x.add_, 1)] * n_calls)


def input_sets(v, tokens: int, nq: int, niq: int, device="cuda",
               slots: Optional[str] = None) -> tuple[list[dict], str, int, int]:
    """Input sets to rotate (with outputs), their slots, the op's bytes, and how many calls one graph
    replays: enough sets that the working set is ≥ 4× L2 (within 8 GB), enough calls that
    a replay lasts a few ms. Slots as engines make them unless named: decode up to
    DECODE_UP_TO tokens, prefill above."""
    slots = slots or ("decode" if tokens <= DECODE_UP_TO else "prefill")
    probe = make_inputs(v, tokens, nq, niq, slots=slots, device=device, seed=0)
    nbytes = op_bytes(v, probe)
    n_sets = max(1, min(64, math.ceil(4 * L2_BYTES / nbytes), (8 << 30) // nbytes))
    sets = [with_outputs(probe)] + [with_outputs(make_inputs(v, tokens, nq, niq, slots=slots,
                                                            device=device, seed=i))
                                    for i in range(1, n_sets)]
    n_calls = max(n_sets, min(400, max(8, int(2e9 / max(nbytes, 1) // 1000))))
    return sets, slots, nbytes, n_calls


def run_case(v, tp: int, tokens: int, peers: list[str], compiled: dict, compile_min_tokens: int) -> dict:
    nq, _, niq = TP[tp]
    sets, slots, nbytes, n_calls = input_sets(v, tokens, nq, niq)
    n_sets = len(sets)
    stats = check_against_reference(sets[0], fused_qknorm_rope_cache, ref_device="cuda")
    identical = min(s["identical"] for s in stats.values())
    ours = [functools.partial(fused_qknorm_rope_cache, **sets[i % n_sets]) for i in range(n_calls)]
    launch = tuning.launch_used(torch.cuda.get_device_name(), v, tokens)
    rec = {
        "contract": v.contract.name, "variant": v.uri, "tp": tp, "tokens": tokens, "slots": slots,
        "dtype": "bf16", "kv": v.kv_scale.value, "index": v.index_dtype.value if v.index_dtype else None,
        "bytes": nbytes, "input_sets": n_sets, "calls_per_graph": n_calls,
        "identical_min": identical,
        "pipeline_depth": launch.depth, "tokens_per_tile": launch.tile, "lanes_per_thread": launch.lanes,
        "v_written": {V_LOOP_ON: "V loop", V_LOOP_OFF: "main loop"}.get(launch.v_loop),
        "kv_groups": launch.groups or None,  # none where K/V have no per-token scales
        "us": graph_us(ours),
        "us_event_per_call": statistics.median(events_ms(ours[0], 30)) * 1e3,
    }
    rec["gbps"] = nbytes / rec["us"] / 1e3
    lay = layouts(v)
    calls: list = []
    for peer in peers:
        if peer == "compile" and tokens < compile_min_tokens:
            continue
        fn = unfused if peer == "eager" else compiled.setdefault(
            (v.uri, tp), torch.compile(unfused, dynamic=True))
        calls = [functools.partial(fn, v, lay, s, s["q_out"], s.get("index_q_out")) for s in sets]
        calls = [calls[i % n_sets] for i in range(min(n_calls, max(n_sets, 20)))]
        try:
            rec[f"{peer}_us"] = graph_us(calls, reps=5)
        except Exception as e:  # a peer that cannot be captured is reported, not fatal
            rec[f"{peer}_us"] = None
            rec[f"{peer}_error"] = f"{type(e).__name__}: {e}"[:300]
    del sets, ours, calls  # every reference to the inputs, so the copy's buffers replace them
    torch.cuda.empty_cache()
    rec["copy_same_bytes_us"] = same_bytes_copy_us(nbytes, n_sets, n_calls)
    return rec


def _host_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def host_overhead(v) -> dict:
    """Host time per eager call of a signature validated before (the GPU is not the limit),
    which signature table served it, and torch's own one-element add_ on the same CPU."""
    args = with_outputs(make_inputs(v, 1, *TP[8][::2], slots="decode", device="cuda", seed=0))
    us = _host_us(lambda: fused_qknorm_rope_cache(**args))
    x = torch.zeros(1, device="cuda")
    table = dispatch.table()
    return {"host_overhead_us": us,
            "host_dispatch": "C++" if not isinstance(table, dispatch.PythonTable) else "Python",
            "host_torch_add_us": _host_us(lambda: x.add_(1))}


def build_costs(variants) -> dict:
    """Cold build seconds per variant (fresh cache) and warm load ms (library on disk)."""
    tc = toolchain.default()
    cold, warm = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            job = build.Job(v.uri, source_of(v))
            t0 = time.perf_counter()
            path = build.build(job, tc, root=Path(tmp))
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            KernelLibrary(str(path), v.uri)
            warm.append((time.perf_counter() - t0) * 1e3)
    return {"cold_build_s": statistics.median(cold), "cold_build_s_max": max(cold),
            "warm_load_ms": statistics.median(warm), "variants": len(variants),
            "compiler": f"{tc.kind} {tc.version} {tc.arch}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where <name>.json goes")
    ap.add_argument("--name", default="h200", help="the result file's name (h200 = the full sweep)")
    ap.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"), help="where the tables go")
    ap.add_argument("--peers", default="eager,compile")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--tp", default="1,4,8")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--compile-min-tokens", type=int, default=1024,
                    help="time the torch.compile peer from this many tokens on (each shape compiles)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peers = [p for p in args.peers.split(",") if p]
    torch.backends.cuda.matmul.allow_tf32 = False
    # The compiled peers share unfused's code: one graph per configuration and TP (12), past
    # dynamo's default limit of 8 (tests/test_peer.py: each is one graph, no break).
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    gpu = torch.cuda.get_device_name()
    copy = copy_bandwidth()
    print(f"{gpu}: copy {copy:.0f} GB/s", flush=True)
    variants = {(name, tp): find_variant(axes, TP[tp][1]) for name, axes in CONFIGS.items()
                for tp in map(int, args.tp.split(","))}
    build.build_many([build.Job(v.uri, source_of(v)) for v in set(variants.values())], toolchain.default())
    result = {
        "gpu": gpu, "torch": torch.__version__, "copy_gbps": copy,
        "command": "python benchmarks/bench.py " + " ".join(sys.argv[1:]),
        "timing": "CUDA-graph replay of calls_per_graph back-to-back calls rotating input_sets "
                  "sets; median of replays; us_event_per_call = CUDA events around one eager call",
        "launch_floor_us": launch_floor_us(),
        **host_overhead(next(iter(variants.values()))),
        "build": build_costs(sorted({v for v in variants.values()}, key=lambda v: v.uri)[:4]),
        "records": [],
    }
    records, compiled = result["records"], {}
    for name in args.configs.split(","):
        for tp in map(int, args.tp.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                with hang_watchdog():
                    rec = run_case(variants[(name, tp)], tp, tokens, peers, compiled, args.compile_min_tokens)
                rec["config"] = name
                rec["pct_copy"] = 100 * rec["gbps"] / copy
                records.append(rec)
                peer_txt = " ".join(f"{p} {rec.get(p + '_us') or float('nan'):.1f}" for p in peers)
                print(f"{name:20s} tp{tp} T={tokens:6d} {rec['us']:9.2f} us {rec['gbps']:7.0f} GB/s "
                      f"{rec['pct_copy']:5.1f}%  event {rec['us_event_per_call']:.1f}  {peer_txt}", flush=True)
        # Written after every configuration, so a run cut short still leaves its results.
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        write_report(out, Path(args.md))
    print(f"host overhead {result['host_overhead_us']:.1f} us/call; build {result['build']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
