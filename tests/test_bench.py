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

from benchmarks.ab import Case, parse_case, parse_sets, run_case
from benchmarks.bench import ROOT, copy_same_bytes
from kvforge.runtime import toolchain
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
    ("base=", {"base": ()}),
    ("base=;moved=KVF_X=1,KVF_Y", {"base": (), "moved": ("KVF_X=1", "KVF_Y")}),
    (" a =KVF_A=-1;b=", {"a": ("KVF_A=-1",), "b": ()}),
])
def test_ab_sets_name_their_definitions(text, expected):
    assert parse_sets(text) == expected


@pytest.mark.parametrize("text,message", [
    ("base", "--sets: expected name=DEFINES, got 'base'"),
    ("=KVF_X", "--sets: expected name=DEFINES, got '=KVF_X'"),
    ("a=;a=KVF_X", "--sets: 'a' named twice"),
    ("a=1X,KVF_Y=2 3", "--sets: a: expected NAME or NAME=VALUE definitions, got ['1X', 'KVF_Y=2 3']"),
])
def test_ab_sets_refuse_what_is_not_a_definition(text, message):
    with pytest.raises(ValueError) as e:
        parse_sets(text)
    assert str(e.value) == message


def test_ab_cases_take_a_config_tp_tokens_and_maybe_a_launch():
    assert parse_case("m3:1:1024") == Case("vllm_m3 bf16", 1, 1024, None)
    assert parse_case("fp8:8:8192:1:4:1:2") == Case("vllm_shuffle16 fp8", 8, 8192, Launch(1, 4, 1, 2))


@pytest.mark.parametrize("text,message", [
    ("m3:1", "expected config:tp:tokens[:depth:tile:v_loop:lanes], got 'm3:1'"),
    ("m4:1:16", "m4:1:16: config 'm4' is not one of m3, sglang, shuffle, fp8"),
    ("m3:x:16", "m3:x:16: expected integers after the config"),
    ("m3:2:16", "m3:2:16: TP 2 is not one of [1, 4, 8]"),
    ("m3:1:0", "m3:1:0: expected at least one token, got 0"),
    ("m3:1:16:1:3:0:1", "m3:1:16:1:3:0:1: tile"),
])
def test_ab_cases_refuse_what_bench_does_not_run(text, message):
    with pytest.raises(ValueError, match="^--cases: " + re.escape(message)):
        parse_case(text)


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
