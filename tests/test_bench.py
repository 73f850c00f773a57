"""The benchmark's same-bytes copy (benchmarks/copy.hip): bench.py times it as what moving
a case's bytes costs at that size, so it must move exactly them (its build, as a dependent
launch: tests/test_build.py; for AMD: tests/test_amd.py). The A/B script's arguments and
run, and the scripts' hang watchdog."""
import dataclasses
import re
import subprocess
import sys
import time

import pytest
import torch

from benchmarks.ab import BuildSet, Case, parse_case, parse_sets, run_case, set_jobs
from benchmarks.bench import CONFIGS, ROOT, TP, copy_same_bytes, find_variant
from kvforge.runtime import build, toolchain
from kvforge.runtime.registry import MissingSourceError, source_of
from kvforge.runtime.tuning import Launch


@pytest.mark.parametrize("src,dst", [
    (torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)),            # sizes differ
    (torch.zeros(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)),            # 24 bytes
    (torch.zeros(9, dtype=torch.int32)[1:], torch.zeros(8, dtype=torch.int32)),        # 4-byte aligned
    (torch.zeros(8, 2, dtype=torch.int32).t(), torch.zeros(2, 8, dtype=torch.int32)),  # not contiguous
])
def test_it_refuses_what_it_cannot_copy_whole(src, dst):
    with pytest.raises(ValueError, match="contiguous, 16-byte aligned tensors of the same size"):
        copy_same_bytes(src, dst)


@pytest.mark.gpu
def test_it_moves_every_byte_and_nothing_more():
    """Over a grid whose last block is partial; a guard vector past the end stays."""
    n = 1000 * 4  # 1000 vectors of 16 bytes: 3 full blocks of 256 and a partial one
    src = torch.randint(-2 ** 31, 2 ** 31 - 1, (n + 4,), dtype=torch.int32, device="cuda")
    dst = torch.full((n + 4,), 7, dtype=torch.int32, device="cuda")
    copy_same_bytes(src[:n], dst[:n])
    torch.cuda.synchronize()
    assert torch.equal(dst[:n], src[:n])
    assert (dst[n:] == 7).all()


# ---- benchmarks/ab.py: builds that differ by definitions, timed side by side ----------
@pytest.mark.parametrize("text,expected", [
    ("base=", {"base": BuildSet()}),
    ("base=;moved=KVF_X=1,KVF_Y", {"base": BuildSet(), "moved": BuildSet(("KVF_X=1", "KVF_Y"))}),
    (" a =KVF_A=-1;b=", {"a": BuildSet(("KVF_A=-1",)), "b": BuildSet()}),
    ("old=@.device/old;new=", {"old": BuildSet((), ".device/old"), "new": BuildSet()}),
    ("old=@../old:KVF_X=1,KVF_Y;new=KVF_X=1", {"old": BuildSet(("KVF_X=1", "KVF_Y"), "../old"),
                                               "new": BuildSet(("KVF_X=1",))}),
    ("old=@/abs/old:", {"old": BuildSet((), "/abs/old")}),
])
def test_ab_sets_name_their_definitions_and_trees(text, expected):
    assert parse_sets(text) == expected


@pytest.mark.parametrize("text,message", [
    ("base", "--sets: expected name=DEFINES or name=@DIR[:DEFINES], got 'base'"),
    ("=KVF_X", "--sets: expected name=DEFINES or name=@DIR[:DEFINES], got '=KVF_X'"),
    ("a=;a=KVF_X", "--sets: 'a' named twice"),
    ("a=1X,KVF_Y=2 3", "--sets: a: expected NAME or NAME=VALUE definitions, got ['1X', 'KVF_Y=2 3']"),
    ("old=@", "--sets: old: expected @DIR[:DEFINES], got '@'"),
    ("old=@:KVF_X", "--sets: old: expected @DIR[:DEFINES], got '@:KVF_X'"),
    ("old=@d:1X", "--sets: old: expected NAME or NAME=VALUE definitions, got ['1X']"),
])
def test_ab_sets_refuse_what_is_not_a_definition(text, message):
    with pytest.raises(ValueError) as e:
        parse_sets(text)
    assert str(e.value) == message


def test_ab_cases_take_a_config_tp_tokens_and_maybe_a_launch():
    assert parse_case("m3:1:1024") == Case("vllm_m3 bf16", 1, 1024, None)
    assert parse_case("fp8:8:8192:1:4:1:2") == Case("vllm_shuffle16 fp8", 8, 8192, Launch(1, 4, 1, 2))
    assert parse_case("fp8t:8:65536:1:4:2:2:4") == Case("vllm_shuffle16 fp8 per-token", 8, 65536,
                                                          Launch(1, 4, 2, 2, 4))


@pytest.mark.parametrize("text,message", [
    ("m3:1", "expected config:tp:tokens[:depth:tile:v_loop:lanes[:groups]], got 'm3:1'"),
    ("m4:1:16", "m4:1:16: config 'm4' is not one of m3, sglang, shuffle, fp8"),
    ("m3:x:16", "m3:x:16: expected integers after the config"),
    ("m3:2:16", "m3:2:16: TP 2 is not one of [1, 4, 8]"),
    ("m3:1:0", "m3:1:0: expected at least one token, got 0"),
    ("m3:1:16:1:3:0:1", "m3:1:16:1:3:0:1: tile"),
    ("fp8t:8:16:1:2:0:1:3", "fp8t:8:16:1:2:0:1:3: groups must be one of 0, 1, 2, 4, got 3"),
])
def test_ab_cases_refuse_what_bench_does_not_run(text, message):
    with pytest.raises(ValueError, match="^--cases: " + re.escape(message)):
        parse_case(text)


def test_ab_set_on_a_tree_builds_that_trees_sources_and_names_what_it_lacks(tmp_path):
    """`old=@DIR:DEF`: the toolchain adds DEF and reads DIR's headers; each case's variant
    is built once, from DIR/generated/; a case whose variant DIR lacks is refused, naming the
    set, the case and the variant."""
    base = toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90", defines=("KVF_A=1",))
    tree = tmp_path / "old"
    (tree / "include" / "kvforge").mkdir(parents=True)
    (tree / "generated").mkdir()
    with pytest.raises(toolchain.ToolchainError, match="is no kvforge checkout: it has no include/kvforge/ or generated/ "):
        BuildSet((), str(tmp_path)).toolchain_from(base)
    tc = BuildSet(("KVF_X=1",), str(tree)).toolchain_from(base)
    assert tc.defines == ("KVF_A=1", "KVF_X=1") and tc.tree == str(tree.resolve())
    assert BuildSet(("KVF_X=1",)).toolchain_from(base) == toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90",
                                                                         defines=("KVF_A=1", "KVF_X=1"))
    m3, fp8 = (find_variant(CONFIGS[c], TP[8][1]) for c in ("vllm_m3 bf16", "vllm_shuffle16 fp8"))
    (tree / "generated" / f"{m3.uri}.hip").write_text("// old m3\n")
    cases = {"m3:8:16": m3, "m3:8:1024": m3}
    assert set_jobs("old", tc, cases) == [build.Job(m3.uri, "// old m3\n")]
    assert set_jobs("new", base, cases) == [build.Job(m3.uri, source_of(m3))]
    with pytest.raises(MissingSourceError, match=rf"^old: case fp8:8:16: {fp8.uri}: the tree {tc.tree} has no "
                                                 rf"generated/{fp8.uri}.hip \(a variant that tree lacks"):
        set_jobs("old", tc, {**cases, "fp8:8:16": fp8})


@pytest.mark.gpu
def test_ab_times_every_set_after_checking_it():
    """Two builds of one source (a definition nothing reads): both checked, both timed."""
    base = toolchain.default()
    sets = {"base": base, "other": dataclasses.replace(base, defines=base.defines + ("KVF_AB_UNUSED=1",))}
    times = run_case(parse_case("m3:8:16"), sets, rounds=2)
    assert set(times) == {"base", "other"}
    assert all(len(t) == 2 and all(0 < us < 1e3 for us in t) for t in times.values())


def _under_watchdog(seconds: float, body: str) -> tuple[subprocess.CompletedProcess, float]:
    code = f"from benchmarks.bench import hang_watchdog\nimport time\nwith hang_watchdog({seconds}):\n    {body}\n" \
           "time.sleep(2)\nprint('after')"
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - began


def test_the_watchdog_ends_a_block_that_hangs():
    done, took = _under_watchdog(1, "time.sleep(60)")
    assert done.returncode == 1 and "after" not in done.stdout
    assert "Timeout (0:00:01)!" in done.stderr
    assert 'File "<string>", line 4' in done.stderr  # the stack names the line that hung
    assert took < 50


def test_the_watchdog_lets_a_block_that_ends_in_time_go_on():
    done, _ = _under_watchdog(1, "time.sleep(0.1)")  # the 2 s after it: disarmed
    assert done.returncode == 0 and done.stdout == "after\n", done.stderr
