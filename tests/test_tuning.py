"""The tuned launch table (runtime/tuning.py) and the tuner's range building."""
import json

import pytest

from benchmarks.tune import choose, ranges
from codegen.paths import TUNED
from runtime.abi import DEFAULT_PIPELINE_DEPTH, MAX_PIPELINE_DEPTH
from runtime.registry import spec
from runtime.tuning import TuningError, load, parse, pick, table_for


def table(choices):
    return {"device": "GPU X", "choices": choices}


def test_pick_walks_the_ranges_and_defaults_to_zero():
    r = ((3, 1), (100, 2), (None, 1))
    assert [pick(r, t) for t in (1, 3, 4, 100, 101, 10 ** 9)] == [1, 1, 2, 2, 1, 1]
    assert pick((), 5) == 0 and pick(((10, 2),), 11) == 0


@pytest.mark.parametrize("choices,message", [
    ({"v": []}, "v: expected a list of [max_tokens, depth] pairs"),
    ({"v": [[None, 1], [None, 2]]}, "v: range 0: expected [max_tokens > 0, depth] (max_tokens null only in the last), got [None, 1]"),
    ({"v": [[8, 1], [8, 2]]}, "v: range 1: expected [max_tokens > 8, depth]"),
    ({"v": [[8, 0]]}, f"v: range 0: depth must be 1..{MAX_PIPELINE_DEPTH}, got 0"),
    ({"v": [[8, True]]}, f"v: range 0: depth must be 1..{MAX_PIPELINE_DEPTH}, got True"),
    ({"v": [["8", 1]]}, "v: range 0: expected [max_tokens > 0, depth]"),
])
def test_bad_tables_are_refused_with_the_entry_named(choices, message):
    with pytest.raises(TuningError) as e:
        parse(table(choices), "t.json")
    assert str(e.value).startswith("t.json: ") and message in str(e.value)


def test_a_file_that_is_not_json_names_its_line(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"device": "GPU X",\n "choices": {,}}')
    with pytest.raises(TuningError, match=r"x.json:2: not JSON"):
        load(p)


def test_the_table_is_found_by_device_name(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(table({"v": [[16, 1], [None, 2]]})))
    (tmp_path / "b.json").write_text(json.dumps({"device": "GPU Z", "choices": {"v": [[0, 9]]}}))
    t = table_for("GPU X", tmp_path)  # b.json is broken, but for another GPU
    assert t.depth("v", 16) == 1 and t.depth("v", 17) == 2 and t.depth("other", 1) == 0
    assert table_for("GPU Y", tmp_path) is None
    with pytest.raises(TuningError, match="b.json: v: range 0"):
        table_for("GPU Z", tmp_path)


def test_two_tables_for_one_device_are_an_error(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps(table({"v": [[None, 2]]})))
    with pytest.raises(TuningError, match=r"a.json, b.json all tune 'GPU X'; keep one"):
        table_for("GPU X", tmp_path)


def test_the_tuner_keeps_the_default_unless_another_depth_is_clearly_faster():
    other = 1 if DEFAULT_PIPELINE_DEPTH != 1 else 2
    assert choose({DEFAULT_PIPELINE_DEPTH: 10.0, other: 9.9}) == DEFAULT_PIPELINE_DEPTH
    assert choose({DEFAULT_PIPELINE_DEPTH: 10.0, other: 9.0}) == other


def test_the_tuner_splits_ranges_between_measured_counts_and_merges_equal_ones():
    assert ranges([(1, 1), (16, 1), (128, 2), (1024, 2)]) == [[45, 1], [None, 2]]
    assert ranges([(1, 2)]) == [[None, 2]]


def test_stored_tables_load_and_name_listed_variants():
    uris = {v.uri for v in spec().variants}
    for path in sorted(TUNED.glob("*.json")):
        t = load(path)
        assert set(t.choices) <= uris, path


def test_the_scripts_build_their_rotating_input_sets():
    """bench.py and tune.py share input_sets; on the CPU it shows the rotation rule."""
    from benchmarks.bench import L2_BYTES, input_sets

    v = spec().variants[0]
    sets, slots, nbytes, n_calls = input_sets(v, 4, 8, 2, device="cpu")
    assert slots == "decode" and len(sets) == 64  # tiny calls: capped at 64 sets
    assert n_calls >= len(sets) and all("q_out" in s for s in sets)  # each set replayed
    assert nbytes * len(sets) < 4 * L2_BYTES  # the cap, not the L2 rule, decided here
