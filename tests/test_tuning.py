"""The tuned launch table (runtime/tuning.py) and the tuner's range building."""
import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.tune import choose, launches, launches_per_count, ranges, sweep, tps
from kvforge.codegen.lanes import lane_map_of
from kvforge.codegen.layout import v_transposed
from kvforge.codegen.model import Rope
from kvforge.codegen.paths import TUNED
from kvforge.runtime.abi import (LAUNCH_ABI, DEFAULT_KV_GROUPS, DEFAULT_LANES_PER_THREAD, DEFAULT_PIPELINE_DEPTH,
                                 DEFAULT_TOKENS_PER_TILE, KV_GROUPS, MAX_LANES_PER_THREAD, MAX_PIPELINE_DEPTH,
                                 V_LOOP_DEFAULT, V_LOOP_MIN_TOKENS, V_LOOP_OFF, V_LOOP_ON)
from kvforge.runtime.registry import spec
from kvforge.runtime.tuning import DEFAULT, Launch, TuningError, load, parse, pick, splits_kv, table_for

ROOT = Path(__file__).resolve().parent.parent


def table(choices):
    return {"device": "GPU X", "abi": LAUNCH_ABI, "choices": choices}


def test_pick_walks_the_ranges_and_defaults_to_zero():
    a, b = Launch(1, 1, 1, 1), Launch(2, 2, 2, 2)
    r = ((3, a), (100, b), (None, a))
    assert [pick(r, t) for t in (1, 3, 4, 100, 101, 10 ** 9)] == [a, a, b, b, a, a]
    assert pick((), 5) == DEFAULT == (0, 0, 0, 0, 0) and pick(((10, b),), 11) == DEFAULT


@pytest.mark.parametrize("choices,message", [
    ({"v": []}, "v: expected a list of [max_tokens, depth, tile, v_loop, lanes, groups] entries"),
    ({"v": [[None, 1, 1, 0, 1, 0], [None, 2, 1, 0, 1, 0]]}, "v: range 0: expected [max_tokens > 0, depth, tile, v_loop, lanes, groups] (max_tokens null only in the last), got [None, 1, 1, 0, 1, 0]"),
    ({"v": [[8, 1, 1, 0, 1, 0], [8, 2, 1, 0, 1, 0]]}, "v: range 1: expected [max_tokens > 8, depth, tile, v_loop, lanes, groups]"),
    ({"v": [[8, 1, 2, 0, 1]]}, "v: range 0: expected [max_tokens > 0, depth, tile, v_loop, lanes, groups] (max_tokens null only in the last), got [8, 1, 2, 0, 1]"),
    ({"v": [[8, 0, 1, 0, 1, 0]]}, f"v: range 0: depth must be 1..{MAX_PIPELINE_DEPTH}, got 0"),
    ({"v": [[8, True, 1, 0, 1, 0]]}, f"v: range 0: depth must be 1..{MAX_PIPELINE_DEPTH}, got True"),
    ({"v": [[8, 1, 0, 0, 1, 0]]}, "v: range 0: tile must be one of 1, 2, 4, got 0"),
    ({"v": [[8, 1, 3, 0, 1, 0]]}, "v: range 0: tile must be one of 1, 2, 4, got 3"),
    ({"v": [[8, 1, 8, 0, 1, 0]]}, "v: range 0: tile must be one of 1, 2, 4, got 8"),
    ({"v": [[8, 1, 1, 3, 1, 0]]}, "v: range 0: v_loop must be 0 (default), 1 (off) or 2 (on), got 3"),
    ({"v": [[8, 1, 1, None, 1, 0]]}, "v: range 0: v_loop must be 0 (default), 1 (off) or 2 (on), got None"),
    ({"v": [[8, 1, 1, 0, 0, 0]]}, f"v: range 0: lanes must be 1..{MAX_LANES_PER_THREAD}, got 0"),
    ({"v": [[8, 1, 1, 0, 3, 0]]}, f"v: range 0: lanes must be 1..{MAX_LANES_PER_THREAD}, got 3"),
    ({"v": [[8, 1, 1, 0, 2.0, 0]]}, f"v: range 0: lanes must be 1..{MAX_LANES_PER_THREAD}, got 2.0"),
    ({"v": [[8, 1, 1, 0, 1, 3]]}, "v: range 0: groups must be 0 (default) or one of 1, 2, 4, got 3"),
    ({"v": [[8, 1, 1, 0, 1, 8]]}, "v: range 0: groups must be 0 (default) or one of 1, 2, 4, got 8"),
    ({"v": [[8, 1, 1, 0, 1, None]]}, "v: range 0: groups must be 0 (default) or one of 1, 2, 4, got None"),
    ({"v": [["8", 1, 1, 0, 1, 0]]}, "v: range 0: expected [max_tokens > 0, depth, tile, v_loop, lanes, groups]"),
])
def test_bad_tables_are_refused_with_the_entry_named(choices, message):
    with pytest.raises(TuningError) as e:
        parse(table(choices), "t.json")
    assert str(e.value).startswith("t.json: ") and message in str(e.value)


@pytest.mark.parametrize("abi,found", [(None, "names no ABI (it predates ABI 5)"), (4, "was tuned for ABI 4"),
                                       (LAUNCH_ABI - 1, f"was tuned for ABI {LAUNCH_ABI - 1}"),
                                       (str(LAUNCH_ABI), f"was tuned for ABI '{LAUNCH_ABI}'"),
                                       (True, "was tuned for ABI True")])
def test_a_table_tuned_for_another_abi_is_refused(abi, found):
    data = {k: v for k, v in table({"v": [[None, 1, 1, 0, 1, 0]]}).items() if k != "abi" or abi is not None}
    if abi is not None:
        data["abi"] = abi
    with pytest.raises(TuningError) as e:
        parse(data, "t.json")
    assert str(e.value) == (f"t.json: {found}, but this runtime's launches are ABI {LAUNCH_ABI} "
                            "(a field may mean something else): re-run benchmarks/tune.py")


def test_a_file_that_is_not_json_names_its_line(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"device": "GPU X",\n "choices": {,}}')
    with pytest.raises(TuningError, match=r"x.json:2: not JSON"):
        load(p)


def test_the_table_is_found_by_device_name(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(table({"v": [[16, 1, 1, 1, 1, 0], [None, 2, 2, 2, 2, 4]]})))
    (tmp_path / "b.json").write_text(json.dumps({"device": "GPU Z", "abi": LAUNCH_ABI, "choices": {"v": [[0, 9, 1, 0, 1, 0]]}}))
    t = table_for("GPU X", tmp_path)  # b.json is broken, but for another GPU
    launch = lambda uri, n: pick(t.choices.get(uri, ()), n)  # noqa: E731
    assert launch("v", 16) == (1, 1, 1, 1, 0) and launch("v", 17) == (2, 2, 2, 2, 4) and launch("other", 1) == DEFAULT
    assert table_for("GPU Y", tmp_path) is None
    with pytest.raises(TuningError, match="b.json: v: range 0"):
        table_for("GPU Z", tmp_path)


def test_two_tables_for_one_device_are_an_error(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps(table({"v": [[None, 2, 2, 0, 1, 0]]})))
    with pytest.raises(TuningError, match=r"a.json, b.json all tune 'GPU X'; keep one"):
        table_for("GPU X", tmp_path)


def _variant(transposed: bool, split: bool = False, nkv: int = 0):
    """A listed variant whose V is (not) transposed, with(out) per-token K/V scales, of nkv kv heads if given."""
    return next(v for v in spec().variants if v_transposed(v) == transposed and splits_kv(v) == split
                and nkv in (0, v.num_kv_heads))


def test_the_tuner_keeps_the_default_unless_another_launch_is_clearly_faster():
    default = DEFAULT.resolved(1024, _variant(True))
    other = Launch(1 if default.depth != 1 else 2, default.tile, default.v_loop)
    assert choose({"tp1": {default: 10.0, other: 9.9}}, default) == default
    assert choose({"tp1": {default: 10.0, other: 9.0}}, default) == other


def test_one_launch_serves_every_tp_of_a_variant_so_the_tuner_minimizes_the_worst_slowdown():
    """Session 21's tune at TP8 alone took depth 2, tile 4 for sglang at 1024 tokens (3.32
    against 3.43 µs), which ran 5.94 µs at TP4 against 5.17 at depth 1, tile 2."""
    d2t4, d1t2 = Launch(2, 4, V_LOOP_DEFAULT, 1), Launch(1, 2, V_LOOP_DEFAULT, 1)
    assert choose({"tp8": {d2t4: 3.32, d1t2: 3.43}}, d1t2) == d2t4
    assert choose({"tp8": {d2t4: 3.32, d1t2: 3.43}, "tp4": {d2t4: 5.94, d1t2: 5.17}}, d2t4) == d1t2
    variants = {v.num_kv_heads: v for v in spec().variants}
    assert tps(variants[1]) == [4, 8] and tps(variants[4]) == [1]
    assert launches_per_count(variants[1]) == 2 * len(sweep(variants[1]))


def test_defaults_resolve_as_the_library_does():
    """The library's V loop from KVF_V_LOOP_MIN_TOKENS tokens, where V is transposed; a
    V that is not has no V loop to name; K/V groups only where K/V have per-token scales."""
    depth, tile, lanes = DEFAULT_PIPELINE_DEPTH, DEFAULT_TOKENS_PER_TILE, DEFAULT_LANES_PER_THREAD
    shuffle, nhd, per_token = _variant(True), _variant(False), _variant(True, split=True)
    assert DEFAULT.resolved(V_LOOP_MIN_TOKENS - 1, shuffle) == (depth, tile, V_LOOP_OFF, lanes, 0)
    assert DEFAULT.resolved(V_LOOP_MIN_TOKENS, shuffle) == (depth, tile, V_LOOP_ON, lanes, 0)
    assert DEFAULT.resolved(V_LOOP_MIN_TOKENS, nhd) == (depth, tile, V_LOOP_DEFAULT, lanes, 0)
    assert DEFAULT.resolved(1, per_token) == (depth, tile, V_LOOP_OFF, lanes, DEFAULT_KV_GROUPS)
    assert Launch(2, 1, V_LOOP_OFF, 2, 4).resolved(10 ** 6, shuffle) == (2, 1, V_LOOP_OFF, 2, 0)
    assert Launch(2, 1, V_LOOP_OFF, 2, 4).resolved(10 ** 6, per_token) == (2, 1, V_LOOP_OFF, 2, 4)
    assert Launch(2, 1, V_LOOP_ON).resolved(1, nhd) == (2, 1, V_LOOP_DEFAULT, lanes, 0)


def test_launch_with_refuses_a_launch_the_library_would_not_take():
    from kvforge.runtime.api import launch_with

    with pytest.raises(ValueError, match=r"^launch_with: depth must be 0\.\.\d+, got 9; v_loop must be 0\.\.2, got -1$"):
        launch_with(Launch(9, 1, -1))
    with pytest.raises(ValueError, match=r"^launch_with: tile must be one of 0, 1, 2, 4, got 3$"):
        launch_with(Launch(1, 3, 0))
    with pytest.raises(ValueError, match=rf"^launch_with: lanes must be 0\.\.{MAX_LANES_PER_THREAD}, got 3$"):
        launch_with(Launch(1, 1, 0, 3))
    with pytest.raises(ValueError, match=r"^launch_with: groups must be one of 0, 1, 2, 4, got 3$"):
        launch_with(Launch(1, 1, 0, 1, 3))


def test_the_tuner_times_both_v_places_only_where_v_is_transposed():
    by_transposed = {}
    for v in spec().variants:
        by_transposed.setdefault(v_transposed(v), v)
    assert {launch.v_loop for launch in launches(by_transposed[True])} == {V_LOOP_OFF, V_LOOP_ON}
    assert {launch.v_loop for launch in launches(by_transposed[False])} == {V_LOOP_DEFAULT}
    assert {(d, t) for d, t, *_ in launches(by_transposed[True])} == \
        {(d, t) for d in range(1, MAX_PIPELINE_DEPTH + 1) for t in (1, 2, 4)}
    assert len(launches(by_transposed[True])) == 2 * MAX_PIPELINE_DEPTH * 3 * MAX_LANES_PER_THREAD


def test_the_tuner_times_every_lane_count_a_variant_has():
    for v in spec().variants:
        most = lane_map_of(v).max_sub
        assert {launch.lanes for launch in launches(v)} == set(range(1, most + 1)), v.uri
    assert {lane_map_of(v).max_sub for v in spec().variants} == {1, 2}


def test_the_tuner_times_k_v_groups_only_where_k_v_have_per_token_scales():
    """Every count a library takes is a launch it distinguishes (the GPU tests run them all);
    the sweep holds the default's, the finalists are timed at the others."""
    for v in spec().variants:
        groups = {launch.groups for launch in launches(v)}
        assert groups == (set(KV_GROUPS) if splits_kv(v) else {0}), v.uri
        assert {launch.groups for launch in sweep(v)} == {DEFAULT_KV_GROUPS if splits_kv(v) else 0}, v.uri
        assert len(launches(v)) == len(sweep(v)) * len(groups), v.uri
    assert any(splits_kv(v) for v in spec().variants)


def test_the_tuner_splits_ranges_between_measured_counts_and_merges_equal_ones():
    a, b, c = Launch(1, 1, 0, 1), Launch(2, 2, 0, 1), Launch(2, 1, 0, 1)
    assert ranges([(1, a), (16, a), (128, b), (1024, b)]) == [[45, 1, 1, 0, 1, 0], [None, 2, 2, 0, 1, 0]]
    assert ranges([(1, a), (16, c), (128, c)]) == [[4, 1, 1, 0, 1, 0], [None, 2, 1, 0, 1, 0]]
    assert ranges([(1, b)]) == [[None, 2, 2, 0, 1, 0]]
    off, on, two, four = Launch(1, 2, 1, 1, 2), Launch(1, 2, 2, 1, 2), Launch(1, 2, 2, 2, 2), Launch(1, 2, 2, 2, 4)
    assert ranges([(1024, off), (8192, on), (32768, two), (65536, four)]) == \
        [[2896, 1, 2, 1, 1, 2], [16384, 1, 2, 2, 1, 2], [46340, 1, 2, 2, 2, 2], [None, 1, 2, 2, 2, 4]]


def test_the_v_place_is_the_one_with_the_smaller_worse_slowdown_over_both_slot_patterns():
    off, on = Launch(1, 2, V_LOOP_OFF), Launch(2, 2, V_LOOP_ON)

    def place(prefill, decode, current):
        return choose({"tp1": prefill, "tp1-decode": decode}, current)
    # prefill 6% faster in the V loop, decode 1.31x faster in the main loop: the main loop
    assert place({off: 50.5, on: 47.6}, {off: 89.0, on: 117.0}, on) == off
    # prefill 2.1x faster in the V loop: the V loop, though decodes lose 1.31x
    assert place({off: 99.3, on: 47.6}, {off: 89.0, on: 117.0}, off) == on
    # worse slowdowns 1.030 (main loop) and 1.011 (V loop): within the margin, the current stays
    assert place({off: 103.0, on: 100.0}, {off: 100.0, on: 101.1}, off) == off
    assert place({off: 103.0, on: 100.0}, {off: 100.0, on: 101.1}, on) == on
    # only launches timed in every pattern compete, and a prefill's slowdown is against its
    # fastest launch: 1.25 (main loop) against 1.2 and 1.03, where against the pair's faster
    # the V loop's 1.03 would be within the margin of the main loop's 1.042
    other = Launch(2, 4, V_LOOP_ON)
    assert place({off: 50.5, on: 47.6, other: 40.0}, {off: 89.0, on: 117.0}, on) == off
    assert place({off: 50.0, on: 48.0, other: 40.0}, {off: 100.0, on: 103.0}, off) == on


def _fake_tuner(monkeypatch):
    """tune.main without a GPU: every launch of a count takes 1 s of a fake clock and times
    the same, so each pick is the default. Returns the (uri, tokens) measured, in order."""
    import benchmarks.tune as tune

    monkeypatch.setenv("KVFORGE_ARCH", "sm_90")
    monkeypatch.setattr(tune.torch.cuda, "get_device_name", lambda *a: "GPU X")
    monkeypatch.setattr(tune.build, "build_many", lambda *a, **k: None)
    clock, timed = [0.0], []
    monkeypatch.setattr(tune.time, "monotonic", lambda: clock[0])

    def measure_count(v, tokens, confirm_within):
        timed.append((v.uri, tokens))
        if len(timed) == getattr(measure_count, "cut_at", None):
            raise KeyboardInterrupt  # the device call's time ran out
        clock[0] += launches_per_count(v)
        return {f"tp{tp}": {tune._key(launch): 10.0 for launch in launches(v)} for tp in tps(v)}

    monkeypatch.setattr(tune, "measure_count", measure_count)
    return tune, measure_count, timed


def test_the_tuner_resumes_a_run_cut_short_and_retimes_what_was_rebuilt(tmp_path, monkeypatch, capsys):
    tune, measure_count, timed = _fake_tuner(monkeypatch)
    argv = ["tune.py", "--out", str(tmp_path), "--tokens", "1,16"]
    monkeypatch.setattr("sys.argv", argv)
    measure_count.cut_at = 4  # in the second variant's second count
    with pytest.raises(KeyboardInterrupt):
        tune.main()
    partial = json.loads((tmp_path / "h200.json.partial").read_text())
    first, second = timed[0][0], timed[2][0]
    assert list(partial["choices"]) == [first]
    assert partial["measured_us"][second].keys() == {"1"}  # the count finished before the cut is kept
    with pytest.raises(SystemExit):
        tune.main()  # without --resume it would throw the run away
    assert "holds a run cut short: pass --resume to continue it, or remove it" in capsys.readouterr().err

    key = tune.build.cache_key
    monkeypatch.setattr(tune.build, "cache_key",  # the first variant's kernel changed since
                        lambda source, tc: "new" if first in source else key(source, tc))
    monkeypatch.setattr("sys.argv", argv + ["--resume"])
    timed.clear()
    measure_count.cut_at = None
    assert tune.main() == 0
    assert "resuming: 0 variants and 1 counts of others from" in capsys.readouterr().out
    assert timed[:3] == [(first, 1), (first, 16), (second, 16)]
    assert len(timed) == len(tune.CONFIGS) * 2 * 2 - 1
    assert not (tmp_path / "h200.json.partial").exists()
    assert len(load(tmp_path / "h200.json").choices) == len(tune.CONFIGS) * 2
    # with --out alone, the timings go beside the table: every count of every variant, the
    # resumed ones and the rebuilt first variant's new build key among them
    timings = tune.read_timings((tmp_path / "h200_tune.jsonl").read_text())
    assert {uri: set(counts) for uri, counts in timings["measured_us"].items()} == \
        {uri: {"1", "16"} for uri in load(tmp_path / "h200.json").choices}
    assert timings["builds"][first] == "new"
    table = json.loads((tmp_path / "h200.json").read_text())
    assert list(table) == [k for k in tune.TABLE_KEYS if k != "retuned"] and table["timings"] == "benchmarks/results/h200_tune.jsonl"
    assert table["device"] == timings["device"] == "GPU X" and table["date"] == timings["date"]


def test_a_filtered_run_retunes_its_variants_within_the_table(tmp_path, monkeypatch, capsys):
    """--filter times only the variants it names; the others keep their choices and timings,
    and the table records the run beside the first one's provenance."""
    tune, measure_count, timed = _fake_tuner(monkeypatch)
    monkeypatch.setattr("sys.argv", ["tune.py", "--out", str(tmp_path), "--tokens", "1,16"])
    assert tune.main() == 0
    first = json.loads((tmp_path / "h200.json").read_text())
    glob = "*kvpertokenhead*"
    retimed = sorted(uri for uri in first["choices"] if "kvpertokenhead" in uri)
    assert retimed and len(retimed) < len(first["choices"])
    faster = Launch(1, 4, 0, 2)

    def two_lanes_faster(v, tokens, confirm_within):  # lanes 2, tile 4 at depth 1: 10% faster
        out = measure_count(v, tokens, confirm_within)
        for times in out.values():
            for key in times:
                if tune._launch(key)._replace(v_loop=0, groups=0) == faster:
                    times[key] = 9.0
        return out

    monkeypatch.setattr(tune, "measure_count", two_lanes_faster)
    monkeypatch.setattr("sys.argv", ["tune.py", "--out", str(tmp_path), "--tokens", "1,16", "--filter", glob])
    timed.clear()
    assert tune.main() == 0
    assert sorted({uri for uri, _ in timed}) == retimed
    table = json.loads((tmp_path / "h200.json").read_text())
    assert {uri: r for uri, r in table["choices"].items() if uri not in retimed} == \
        {uri: r for uri, r in first["choices"].items() if uri not in retimed}
    for uri in retimed:
        assert table["choices"][uri] != first["choices"][uri]
        assert all(r[2] == 4 and r[4] == 2 for r in table["choices"][uri])
    assert (table["command"], table["date"]) == (first["command"], first["date"])
    assert table["retuned"] == [{"command": f"{first['command']} --filter '{glob}'", "date": first["date"],
                                 "torch": first["torch"], "variants": retimed}]
    timings = tune.read_timings((tmp_path / "h200_tune.jsonl").read_text())
    assert set(timings["measured_us"]) == set(table["choices"]) and timings["retuned"] == table["retuned"]
    assert len(load(tmp_path / "h200.json").choices) == len(first["choices"])

    # refused: other token counts, timings of another run, none, another GPU
    capsys.readouterr()
    refusals = [(["--tokens", "1,16,128"], None, "--tokens: {t} was tuned at 1,16: re-tune its variants at the same counts"),
                ([], lambda p: p.write_text(p.read_text().replace(first["date"], "1999-01-01", 1)),
                 "{j} holds another run's timings than {t}, or another tuner format's (this one's: 3): re-tune it whole"),
                ([], lambda p: p.unlink(), "{t}: its timings {j} are missing: re-tune it whole")]
    t, j = tmp_path / "h200.json", tmp_path / "h200_tune.jsonl"
    for args, spoil, message in refusals:
        if spoil:
            spoil(j)
        monkeypatch.setattr("sys.argv", ["tune.py", "--out", str(tmp_path), "--tokens", "1,16", "--filter", glob]
                            + args)
        with pytest.raises(SystemExit):
            tune.main()
        assert message.format(t=t, j=j) in capsys.readouterr().err
    monkeypatch.setattr(tune.torch.cuda, "get_device_name", lambda *a: "GPU Y")
    with pytest.raises(SystemExit):
        tune.main()
    assert f"{t} was tuned on GPU X at ABI {LAUNCH_ABI}, not GPU Y at ABI {LAUNCH_ABI}: re-tune it whole" in \
        capsys.readouterr().err


def test_the_tuner_stops_before_a_count_it_could_not_finish_within_its_budget(tmp_path, monkeypatch, capsys):
    """Each count's estimate is the most seconds a launch took at that count so far."""
    tune, _, timed = _fake_tuner(monkeypatch)
    tuned = sorted({tune.find_variant(axes, nkv) for axes in tune.CONFIGS.values() for nkv in (1, 4)},
                   key=lambda v: v.uri)
    seconds = [launches_per_count(v) for v in tuned]  # 1 s a launch on the fake clock
    budget = sum(seconds[:3]) - 1  # the third, at the 1 s a launch the first of its TPs took, does not fit
    monkeypatch.setattr("sys.argv", ["tune.py", "--out", str(tmp_path), "--tokens", "1", "--budget-s", str(budget)])
    assert tune.main() == 3
    assert [uri for uri, _ in timed] == [tuned[0].uri, tuned[1].uri]
    assert (f"stopping within --budget-s {budget} before {tuned[2].uri} T=1; " in capsys.readouterr().out)
    assert len(json.loads((tmp_path / "h200.json.partial").read_text())["choices"]) == 2


def test_the_tuner_picks_from_what_it_measured_alone():
    """A table's choices follow from its measured_us: the 2% rule over the variant's TPs,
    then V's place over them and the decode-timed pair."""
    from benchmarks.tune import _key
    from benchmarks.tune import pick as tune_pick

    v = _variant(True, nkv=1)
    off, on = DEFAULT.resolved(1024, v)._replace(v_loop=V_LOOP_OFF), DEFAULT.resolved(1024, v)
    assert on.v_loop == V_LOOP_ON
    measured = {"tp4": {_key(launch): 100.0 for launch in launches(v)} | {_key(off): 97.0},
                "tp8": {_key(launch): 50.0 for launch in launches(v)}}
    assert tune_pick(v, 1024, measured) == off  # 3% faster at TP4, as fast at TP8
    assert tune_pick(v, 1024, measured | {"tp8": measured["tp8"] | {_key(off): 51.5}}) == on  # 3% slower there
    decode = {"tp4-decode": {_key(off): 120.0, _key(on): 100.0}, "tp8-decode": {_key(off): 60.0, _key(on): 50.0}}
    assert tune_pick(v, 1024, measured | decode) == on  # the main loop's decodes are 1.2x slower


def test_the_tuner_times_each_tp_then_the_decode_pair_where_v_is_transposed(monkeypatch):
    """At 1024 tokens a 1-kv-head SHUFFLE variant is timed at TP4 and TP8; the prefills'
    choice (the smallest worst slowdown, not the fastest at either TP) and the other V
    place's best by the same measure are timed again with decode slots."""
    import benchmarks.tune as tune

    v = _variant(True, nkv=1)
    steady, tp4_only = Launch(1, 2, V_LOOP_OFF, 1), Launch(2, 4, V_LOOP_ON, 1)
    us = {steady: {4: 95.0, 8: 95.0}, tp4_only: {4: 90.0, 8: 100.0}, Launch(1, 4, V_LOOP_ON, 2): {4: 110.0, 8: 90.0}}
    calls = []

    def time_launches(v, tokens, candidates, tp, slots=None):
        calls.append((tp, slots, len(candidates)))
        return {x: us.get(x, {}).get(tp, 105.0) for x in candidates}

    monkeypatch.setattr(tune, "time_launches", time_launches)
    measured = tune.measure_count(v, 1024, 0.0)
    n = len(launches(v))
    assert calls == [(4, None, n), (8, None, n), (4, "decode", 2), (8, "decode", 2)]
    assert set(measured) == {"tp4", "tp8", "tp4-decode", "tp8-decode"}
    # worst slowdowns: steady 95/90, tp4_only 100/90, the TP8-fastest 110/90, the rest 105/90
    assert tune.pick(v, 1024, {k: measured[k] for k in ("tp4", "tp8")}) == steady
    assert set(measured["tp4-decode"]) == set(measured["tp8-decode"]) == {tune._key(steady), tune._key(tp4_only)}
    # the decodes (the fake times them as the prefills) keep the choice
    assert tune.pick(v, 1024, measured) == steady


def test_the_launches_that_could_win_are_timed_twice_keeping_their_faster_times(monkeypatch):
    """Session 22: a launch timed 88.81 µs in the sweep, 84.8-85.5 in four rounds after it.
    The finalists (worst slowdown within 5% of the best's, and the default however far
    behind) are timed again in reverse order, each keeping its faster time; a launch 6%
    behind is not. The decode pair then starts from the confirmed choice."""
    import benchmarks.tune as tune

    v = _variant(True, nkv=1)
    current = DEFAULT.resolved(1024, v)
    unlucky, behind = Launch(2, 4, V_LOOP_ON, 2), Launch(1, 1, V_LOOP_OFF, 1)
    assert current not in (unlucky, behind) and current.v_loop == V_LOOP_ON
    sweep, second = {current: 86.0, unlucky: 88.8, behind: 91.2}, {current: 87.5, unlucky: 83.0}
    calls = []

    def time_launches(v, tokens, candidates, tp, slots=None):
        calls.append((tp, slots, list(candidates)))
        times = sweep if len(calls) <= 2 else sweep | second
        return {x: times.get(x, 100.0) * tp / 4 for x in candidates}

    monkeypatch.setattr(tune, "time_launches", time_launches)
    measured = tune.measure_count(v, 1024, 0.05)
    assert [c[:2] for c in calls] == [(4, None), (8, None), (4, None), (8, None), (4, "decode"), (8, "decode")]
    assert calls[2][2] == calls[3][2] == sorted([current, unlucky], reverse=True)
    assert measured["tp4"][tune._key(unlucky)] == 83.0 and measured["tp4"][tune._key(current)] == 86.0
    assert calls[4][2] == [unlucky, behind]  # the confirmed choice and the main loop's best
    assert tune.pick(v, 1024, measured) == unlucky
    calls.clear()
    assert tune.pick(v, 1024, tune.measure_count(v, 1024, 0.0)) == current  # timed once: 88.8 stays
    assert len(calls) == 4
    assert tune.finalists({"tp4": {unlucky: 100.0, behind: 103.0, current: 110.0}}, current, 0.05) == \
        sorted([unlucky, behind, current])


def test_the_sweeps_finalists_are_timed_at_the_other_k_v_group_counts_where_one_can_win(monkeypatch):
    """Session 55: per-token K/V heads in four groups ran 3.6% faster at TP8 65536 at a
    launch with V in its own loop, and slower where V runs in the main loop. The sweep runs at
    the default two groups; its finalists (within 5% of its best, and the default) are timed
    at one and four, and the confirm round then takes the finalists of everything timed."""
    import benchmarks.tune as tune

    v = _variant(True, split=True, nkv=1)
    current = DEFAULT.resolved(65536, v)
    near, far = Launch(1, 4, V_LOOP_ON, 2, DEFAULT_KV_GROUPS), Launch(1, 1, V_LOOP_OFF, 1, DEFAULT_KV_GROUPS)
    four = near._replace(groups=4)
    assert current.groups == DEFAULT_KV_GROUPS and near != current and {near, far} <= set(sweep(v))
    us = {current: 100.0, near: 101.5, far: 104.0, four: 96.0}
    calls = []

    def time_launches(v, tokens, candidates, tp, slots=None):
        calls.append((tp, list(candidates)))
        return {x: us.get(x, 110.0) * tp / 4 for x in candidates}

    monkeypatch.setattr(tune, "time_launches", time_launches)
    measured = tune.measure_count(v, 65536, 0.05)
    assert [(tp, n) for tp, n in calls[:2]] == [(4, sweep(v)), (8, sweep(v))]
    regrouped = [launch._replace(groups=g) for launch in sorted([current, near, far]) for g in (1, 4)]
    assert calls[2] == (4, regrouped) and calls[3] == (8, regrouped)
    assert calls[4] == (4, sorted([current, four], reverse=True)) and len(calls) == 6  # the confirm round
    assert tune.pick(v, 65536, measured) == four
    # where no group count can win, nothing moves; a variant without per-token scales times none
    us[four] = 99.0
    assert tune.pick(v, 65536, tune.measure_count(v, 65536, 0.05)) == current
    calls.clear()
    plain = _variant(True, nkv=1)
    tune.measure_count(plain, 65536, 0.05)
    assert len(calls) == 4 and {launch.groups for _, c in calls for launch in c} == {0}  # sweep, confirm


def test_stored_tables_load_and_name_listed_variants():
    """...and name a V place (1 or 2) exactly where the variant's V is transposed, no
    more lanes per thread than the variant has, and K/V groups only where it has
    per-token K/V scales."""
    variants = {v.uri: v for v in spec().variants}
    for path in sorted(TUNED.glob("*.json")):
        t = load(path)
        assert set(t.choices) <= set(variants), path
        for uri, entries in t.choices.items():
            v = variants[uri]
            places = {launch.v_loop for _, launch in entries}
            assert places <= ({V_LOOP_OFF, V_LOOP_ON} if v_transposed(v) else {V_LOOP_DEFAULT}), uri
            assert max(launch.lanes for _, launch in entries) <= lane_map_of(v).max_sub, uri
            assert {launch.groups for _, launch in entries} <= (set(KV_GROUPS) if splits_kv(v) else {0}), uri


def _stored_tables():
    """(path, its JSON, its timings file's text) of every table in tuning/."""
    for path in sorted(TUNED.glob("*.json")):
        table = json.loads(path.read_text())
        yield path, table, (ROOT / table["timings"]).read_text()


def test_stored_tables_choices_follow_from_their_measured_times():
    """...as the timings file beside each table (benchmarks/results/) records them, from the
    same run: command, date, device, torch and ABI agree."""
    from benchmarks.tune import TUNER_FORMAT, read_timings
    from benchmarks.tune import pick as tune_pick

    variants = {v.uri: v for v in spec().variants}
    for path, table, text in _stored_tables():
        raw = read_timings(text)
        assert raw.get("tuner") == TUNER_FORMAT, path
        assert all(raw[k] == table[k] for k in ("device", "abi", "command", "date", "torch")), path
        assert set(raw["measured_us"]) == set(table["choices"]) == set(raw["builds"]), path
        for uri, measured in raw["measured_us"].items():
            counts = sorted(map(int, measured))
            assert ranges([(t, tune_pick(variants[uri], t, measured[str(t)])) for t in counts]) == \
                table["choices"][uri], (path, uri)


def test_stored_tables_are_in_the_tuners_compact_form():
    """A table holds what the runtime reads and its provenance, a variant a line; the
    timings file a header line, then a line per variant, count and pattern: each is what
    tune.py writes of its own contents."""
    from benchmarks.tune import TABLE_KEYS, read_timings, table_text, timings_text

    for path, table, text in _stored_tables():
        assert list(table) == [k for k in TABLE_KEYS if k in table] and set(TABLE_KEYS) - set(table) <= {"retuned"}, path
        assert path.read_text() == table_text(table), path
        assert len(path.read_text().splitlines()) <= 300, path
        assert timings_text(read_timings(text)) == text, table["timings"]


def test_the_compacted_table_picks_every_launch_the_old_one_did():
    """tests/tuning_picks_h200.json holds the picks of tuning/h200.json before it was
    compacted (fa89dab, 3031 lines with its measured times), for every variant it lists at
    the token counts named there (each range's last count and the one after it among them),
    per GPU: the runtime reads the compacted table to the same launches. Variants tuned
    since (per-token FP8 on the H200) are the table's own, beyond the fixture."""
    fixture = json.loads((ROOT / "tests" / "tuning_picks_h200.json").read_text())
    variants = {v.uri: v for v in spec().variants}
    for device, by_uri in fixture["picks"].items():
        t = table_for(device)
        assert t is not None and set(by_uri) <= set(t.choices), device
        for uri, picked in by_uri.items():
            tuned = t.ranges_for(variants[uri])
            assert [list(pick(tuned, n)) for n in fixture["tokens"]] == picked, (device, uri)
            gptj = dataclasses.replace(variants[uri], rope=Rope.GPTJ)  # untuned: its NeoX twin's ranges
            assert [list(pick(t.ranges_for(gptj), n)) for n in fixture["tokens"]] == picked, (device, uri)


def test_the_scripts_build_their_rotating_input_sets():
    """bench.py and tune.py share input_sets; on the CPU it shows the rotation rule."""
    from benchmarks.bench import L2_BYTES, input_sets

    v = spec().variants[0]
    sets, slots, nbytes, n_calls = input_sets(v, 4, 8, 2, device="cpu")
    assert slots == "decode" and len(sets) == 64  # tiny calls: capped at 64 sets
    assert n_calls >= len(sets) and all("q_out" in s for s in sets)  # each set replayed
    assert nbytes * len(sets) < 4 * L2_BYTES  # the cap, not the L2 rule, decided here
    assert input_sets(v, 257, 8, 2, device="cpu")[1] == "prefill"
    assert input_sets(v, 257, 8, 2, device="cpu", slots="decode")[1] == "decode"  # the tuner's large decodes


def test_a_range_naming_more_lanes_than_the_variant_holds_is_refused_at_its_first_call(tmp_path):
    """The file is valid (lanes 2 exist); the variant's kernels stop at one lane, which
    only the variant knows: the error names the file and range, not a failed launch."""
    one, two = (next(v for v in spec().variants if lane_map_of(v).max_sub == n)
                for n in (1, 2))
    ranges = [[16, 1, 1, 1, 1, 0], [None, 2, 4, 2, 2, 0]]
    (tmp_path / "t.json").write_text(json.dumps(table({one.uri: ranges, two.uri: ranges})))
    t = table_for("GPU X", tmp_path)
    assert [launch for _, launch in t.ranges_for(two)] == [Launch(1, 1, 1, 1, 0), Launch(2, 4, 2, 2, 0)]
    with pytest.raises(TuningError) as e:
        t.ranges_for(one)
    assert str(e.value) == (f"{tmp_path / 't.json'}: range 1: lanes must be at most 1 for {one.uri} (rotary "
                            "halves not 8-aligned, or one lane per head), got 2: re-run benchmarks/tune.py")


def test_an_untuned_variant_takes_the_launches_of_its_twin():
    """Axes that keep the memory schedule (rotary style, page sizes, the FP8 query output,
    per-token scales) map an untuned variant onto the tuned one that differs in them only."""
    from kvforge.runtime.tuning import twin

    variants = {v.uri: v for v in spec().variants}
    base = variants["vllm_shuffle16_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_fp8_kvpertensor_e4m3fn"]
    per_token = variants["vllm_shuffle16_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_fp8_kvpertokenhead_e4m3fn"]
    assert twin(per_token) == base
    assert twin(dataclasses.replace(per_token, rope=Rope.GPTJ, index_page_size=16)) == base
    q8 = variants["vllm_shuffle16_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvnone_qfp8_e4m3fn"]
    assert twin(q8).uri == "vllm_shuffle16_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvnone"
    pages = variants["vllm_m3_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvnone_kvp16_ip16"]
    assert twin(pages).uri == "vllm_m3_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvnone"
    t = table_for("NVIDIA H200")
    gptj = dataclasses.replace(per_token, rope=Rope.GPTJ)  # untuned: per-tensor NeoX's ranges
    assert t.ranges_for(gptj) == t.ranges_for(base) != ()
    assert per_token.uri in t.choices and t.ranges_for(per_token) != t.ranges_for(base)  # tuned: its own
