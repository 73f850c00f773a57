"""variants.yaml problems: every one names the file, the line and the key path."""
import textwrap

import pytest

from kvforge.codegen.load import parse_spec
from kvforge.codegen.model import SpecError

BASE = textwrap.dedent("""\
    version: 1
    defaults:
      dtype: bf16
      head_dim: 128
      rotary_dim: 1/2
      num_kv_heads: 4
      cos_sin: model
      norm: gemma
      index_mode: full
      index_dtype: model
      kv_scale: none
      fp8: e4m3fn
    contracts:
      paged:
        engine: test
        scales: [none, per_tensor]
        saturation: saturate
        index_slots: shared
        caches:
          k:
            tensor: k_cache
            page_size: 16
            shape: [pages, nkv, D // x, page_size, x]
            index: [page, h, d // x, off, d % x]
            free: [0]
          v:
            tensor: v_cache
            page_size: 16
            shape: [pages, page_size, nkv, D]
            index: [page, off, h, d]
          index:
            tensor: index_cache
            page_size: 16
            shape: [pages, page_size, D]
            index: [page, off, d]
    families:
      - name: base
        axes:
          contract: paged
          kv_scale: [none, per_tensor]
    """)


def errors(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    return info.value.errors


def test_base_is_valid():
    spec = parse_spec(BASE)
    assert [v.uri for v in spec.variants] == [
        "paged_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvnone",
        "paged_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvpertensor_e4m3fn",
    ]


def test_unknown_key():
    assert errors(BASE.replace("  norm: gemma\n", "  norm: gemma\n  colour: red\n")) == [
        "variants.yaml:9: defaults.colour: unknown key (allowed: dtype, head_dim, rotary_dim, "
        "num_kv_heads, cos_sin, norm, rope, index_mode, index_dtype, kv_scale, fp8, kv_page_size, "
        "index_page_size, q_fp8)"]


def test_duplicate_key():
    assert errors(BASE.replace("    engine: test\n", "    engine: test\n    engine: again\n")) == [
        "variants.yaml:16: duplicate key 'engine' (first defined on line 15)"]


def test_bad_expression():
    assert errors(BASE.replace("d % x]", "d %% x]")) == [
        "variants.yaml:24: contracts.paged.caches.k.index[4]: unexpected '%' in 'd %% x' at column 4"]


def test_unknown_symbol_in_expression():
    assert errors(BASE.replace("index: [page, off, h, d]", "index: [page, off, head, d]")) == [
        "variants.yaml:30: contracts.paged.caches.v.index[2]: unknown name 'head' (known: D, d, h, "
        "nkv, off, page, page_size, slot, x) in 'head' at column 1"]


def test_impossible_combination():
    assert errors(BASE.replace("kv_scale: [none, per_tensor]", "kv_scale: [none, per_head]")) == [
        "variants.yaml:40: families.base.axes.kv_scale: contract paged allows kv_scale none, "
        "per_tensor, not per_head (exclude it or change the axis)"]


def test_index_leaving_its_extent():
    assert errors(BASE.replace("index: [page, off, h, d]", "index: [page, off + 1, h, d]")) == [
        "variants.yaml:14: contracts.paged.caches.v: index[1] 'off + 1' leaves the extent 16 of "
        "shape[1] 'page_size' (in variant paged_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvnone)"]


def test_two_elements_on_one_address():
    assert errors(BASE.replace("d % x]", "d % 2]")) == [
        "variants.yaml:14: contracts.paged.caches.k: two (slot, head, dim) elements land on the "
        "same address (in variant paged_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvnone)"]


def test_bad_values_everywhere_are_all_reported():
    text = (BASE.replace("  dtype: bf16\n", "  dtype: bf15\n")
                .replace("saturation: saturate", "saturation: clamp"))
    assert errors(text) == [
        "variants.yaml:3: defaults.dtype: expected one of 'bf16', 'fp16', 'fp32', got 'bf15'",
        "variants.yaml:17: contracts.paged.saturation: expected one of 'saturate', 'passthrough', got 'clamp'",
    ]


def test_odd_rotary_dim_and_unknown_contract():
    text = BASE.replace("      kv_scale: [none, per_tensor]\n",
                        "      kv_scale: [none, per_tensor]\n      rotary_dim: [63]\n"
                        "  - name: other\n    axes:\n      contract: pagedd\n")
    assert errors(text) == [
        "variants.yaml:41: families.base.axes.rotary_dim: rotary_dim must be even and in "
        "[2, head_dim=128], got 63 (exclude it or change the axis)",
        "variants.yaml:44: families.other.axes.contract: unknown contract 'pagedd' (known: paged) "
        "(exclude it or change the axis)",
    ]


def test_runtime_extent_must_be_indexed_by_page():
    assert errors(BASE.replace("index: [page, off, d]", "index: [off, page, d]")) == [
        "variants.yaml:35: contracts.paged.caches.index.index[0]: the run-time dimension 'pages' "
        "must be indexed by 'page' or 'slot', got 'off'"]


def test_free_stride_only_on_page_dims():
    assert errors(BASE.replace("free: [0]", "free: [0, 2]")) == [
        "variants.yaml:25: contracts.paged.caches.k.free: dimension 2 is indexed by 'd // x'; only a "
        "dimension indexed by 'page' or 'slot', or by 'h' ahead of the run-time extent, may have a free stride"]


def test_yaml_syntax_error_points_at_line():
    assert errors(BASE.replace("engine: test", "engine: [test")) == [
        "variants.yaml:16: expected ',' or ']', but got ':'"]


def test_off_is_not_a_boolean():
    # YAML 1.1 would read `off` as false; here it stays the index symbol.
    spec = parse_spec(BASE)
    assert str(spec.contracts["paged"].v.index[1]) == "off"


def test_missing_sections_are_reported_not_crashed_on():
    start, end = BASE.index("defaults:"), BASE.index("contracts:")
    assert errors(BASE[:start] + BASE[end:]) == ["variants.yaml:1: defaults: missing required key"]
    assert errors("version: 1\n") == ["variants.yaml:1: defaults: missing required key",
                                      "variants.yaml:1: contracts: missing required key",
                                      "variants.yaml:1: families: missing required key"]


# ---- any edit either parses or is reported (hypothesis) ---------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LINES = BASE.splitlines()
_VALUES = ["", "0", "-1", "3", "[]", "{}", "x", "1/0", "d // 0", "off", "true", "[a, b]", "[0, 9]",
           "pages", "bf16", "per_head", "e4m3fnuz", "[page, h]", "'('", "null", "*nope", "!!binary x",
           "{a: 1}", "[[1]]", "1.5", "-1/2"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_LINES) - 1), st.sampled_from(_VALUES + [None])),
                min_size=1, max_size=3))
def test_any_edit_parses_or_is_reported(edits):
    lines = list(_LINES)
    for i, value in edits:
        if value is None:
            lines[i] = ""  # a deleted line
        elif ":" in lines[i]:
            key = lines[i].split(":", 1)[0]
            lines[i] = f"{key}: {value}"
    try:
        parse_spec("\n".join(lines) + "\n")
    except SpecError as e:
        assert all(err.startswith("variants.yaml:") for err in e.errors), e.errors


def test_rope_is_an_axis_a_file_written_before_it_need_not_name():
    """BASE names no `rope` default (files before the axis): its variants are NeoX, named as
    before; a family may list GPT-J, and a style that is neither is pinned to its line."""
    spec = parse_spec(BASE.replace("      kv_scale: [none, per_tensor]\n",
                                   "      kv_scale: [none, per_tensor]\n      rope: [neox, gptj]\n"))
    assert sorted(v.uri for v in spec.variants if v.kv_scale.value == "none") == [
        "paged_bf16_d128_r64_kvh4_csbf16_gemma_gptj_idxfull_model_kvnone",
        "paged_bf16_d128_r64_kvh4_csbf16_gemma_idxfull_model_kvnone"]
    assert errors(BASE.replace("      kv_scale: [none, per_tensor]\n",
                               "      kv_scale: [none, per_tensor]\n      rope: gpt-j\n")) == [
        "variants.yaml:41: families.base.axes.rope: expected one of 'neox', 'gptj', got 'gpt-j' "
        "(exclude it or change the axis)"]
