"""The kernel's shared-memory staging under compute-sanitizer (racecheck, synccheck).

A missing sync between a V group's stage writes and reads can still match the reference
(on the H200 a stage removed its second sync and every output stayed bit-identical,
while racecheck counted 200k hazards), so the staged paths run here under the tools:
the V loop's runs (bf16 one group each; FP8 two groups per run, a warp at head_dim 128
and half a warp at 64), long enough that each group writes several runs, and a decode
(put_v_by_dim) at the default tile and at 4 tokens per tile (a warp one head of four
tokens), each at one and at two head lanes per thread (groups of half as many threads,
blocks of 128). So does the main loop's barrier before the norm factors are read, which
on NVIDIA a thread with a token meets in its first step and one without where it returns
(two instructions: legal only for a barrier that is not .aligned, and session 24's
aligned one hung the H200): prefills of several passes at TP1's heads at every depth,
tile and lane count (on the H200, two lanes at tile 1, the launch that hung, leave one
warp a quarter busy: 109 tokens of 616 lanes in 528 blocks of 128 threads). Run as a
script (the part, then the variants), this file makes those calls.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SANITIZER = shutil.which("compute-sanitizer")
# (tokens: "v-loop" = a prefill as long as v_loop_tokens(v, 1), else decode slots; tile; lanes)
CALLS = [("v-loop", 0, 1), (200, 0, 1), (200, 4, 1), ("v-loop", 0, 2), (200, 0, 2), (200, 4, 2)]
# The main loop's calls: (depth, tile, lanes) at MAIN_TOKENS tokens, TP1's heads (64 q, 4 index).
MAIN_CALLS = [(depth, tile, lanes) for depth in (1, 2) for tile in (1, 2, 4) for lanes in (1, 2)]
MAIN_TOKENS = 1000
PARTS = {
    "staged-v": (len(CALLS), [
        "vllm_shuffle16_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvnone",
        "vllm_shuffle16_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_fp8_kvpertensor_e4m3fn",
        "vllm_shuffle16_bf16_d64_r32_kvh4_csbf16_gemma_idxfull_fp8_kvpertensor_e4m3fn",
    ]),
    "main-loop": (len(MAIN_CALLS), [  # the first hung with session 24's aligned barrier
        "sglang_nhd_bf16_d128_r64_kvh4_csfp32_gemma_idxfull_model_kvnone",
        "vllm_shuffle16_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_fp8_kvpertensor_e4m3fn",
    ]),
}


@pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer is not on PATH")
@pytest.mark.parametrize("part", sorted(PARTS))
@pytest.mark.parametrize("tool", ["racecheck", "synccheck"])
def test_shared_memory_has_no_hazard_under_compute_sanitizer(tool, part):
    calls, uris = PARTS[part]
    cmd = [SANITIZER, "--tool", tool, "--kernel-name", "kns=fused_kernel", "--error-exitcode", "3",
           "--print-limit", "5", sys.executable, __file__, part, *uris]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("identical") == calls * len(uris), out[-4000:]  # every call ran and matched
    assert ("RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors") in out, out[-4000:]


def _calls(part, uris):
    from kvforge.runtime.abi import V_LOOP_OFF, V_LOOP_ON
    from kvforge.runtime.api import launch_with
    from kvforge.runtime.registry import spec
    from kvforge.runtime.testing import check_against_reference, make_inputs, v_loop_tokens
    from kvforge.runtime.tuning import Launch

    variants = {v.uri: v for v in spec().variants}
    for uri in uris:
        v = variants[uri]
        if part == "main-loop":
            calls = [(MAIN_TOKENS, 64, 4, "prefill", Launch(depth, tile, 0, lanes)) for depth, tile, lanes in MAIN_CALLS]
        else:
            # v-loop: one item per group if an SM held 8 blocks; 2 or 3 do: every group writes two or more.
            calls = [(v_loop_tokens(v, 1), 1, 1, "prefill", Launch(0, tile, V_LOOP_ON, lanes)) if tokens == "v-loop"
                     else (tokens, 8, 1, "decode", Launch(0, tile, V_LOOP_OFF, lanes)) for tokens, tile, lanes in CALLS]
        for tokens, nq, niq, slots, launch in calls:
            args = make_inputs(v, tokens, nq, niq, slots=slots, device="cuda", seed=3)
            stats = check_against_reference(args, lambda **a: launch_with(launch, **a)(), ref_device="cuda")
            print(uri, tokens, slots, f"depth {launch.depth} tile {launch.tile} lanes {launch.lanes}", "identical",
                  min(s["identical"] for s in stats.values()), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _calls(sys.argv[1], sys.argv[2:])
