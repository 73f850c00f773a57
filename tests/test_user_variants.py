"""A user's (or an engine's) variants file laid over the shipped one: new contracts and
families without editing the package, errors that point into that file, and the CPU
suite's contract tests covering a contract that exists only there."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvforge.codegen.load import load_spec
from kvforge.codegen.model import SpecError
from kvforge.codegen.paths import VARIANTS_YAML, user_variant_files

REPO = Path(__file__).resolve().parents[1]

# vLLM's HND cache layout [pages, nkv, page_size, D]: no shipped contract has it.
HND = textwrap.dedent("""\
    version: 1
    contracts:
      user_hnd:
        engine: vLLM HND layout (a page's kv heads before its slots)
        scales: [none, per_tensor, per_head]
        saturation: saturate
        index_slots: own
        caches:
          k:
            tensor: k_cache
            page_size: 16
            shape: [pages, nkv, page_size, D]
            index: [page, h, off, d]
            free: [0]
          v:
            tensor: v_cache
            page_size: 16
            shape: [pages, nkv, page_size, D]
            index: [page, h, off, d]
            free: [0]
          index:
            tensor: index_cache
            page_size: 32
            shape: [ipages, page_size, D]
            index: [page, off, d]
            free: [0]
    families:
      - name: user_hnd
        axes:
          contract: user_hnd
          num_kv_heads: [1, 4]
          index_dtype: [model, fp8]
          kv_scale: [none, per_head]
        exclude:
          - {num_kv_heads: 1, kv_scale: per_head}
    """)


@pytest.fixture
def hnd(tmp_path):
    path = tmp_path / "engine_variants.yaml"
    path.write_text(HND)
    return path


def test_an_overlay_adds_its_contracts_and_families(hnd):
    shipped = load_spec(VARIANTS_YAML)
    both = load_spec(VARIANTS_YAML, hnd)
    added = {v.uri for v in both.variants} - {v.uri for v in shipped.variants}
    assert len(added) == 6 and all(u.startswith("user_hnd_") for u in added)
    assert set(both.contracts) == set(shipped.contracts) | {"user_hnd"}
    assert both.source_of("user_hnd") == f"{hnd}:3"
    assert both.families[-1].source == str(hnd)


def test_overlay_errors_point_into_the_overlay(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text(HND.replace("saturation: saturate", "saturation: clamp"))
    with pytest.raises(SpecError) as e:
        load_spec(VARIANTS_YAML, bad)
    assert e.value.errors[0] == (f"{bad}:6: contracts.user_hnd.saturation: expected one of "
                                 "'saturate', 'passthrough', got 'clamp'")
    clash = tmp_path / "clash.yaml"
    clash.write_text("contracts:\n  vllm_m3:\n    engine: mine\n")
    with pytest.raises(SpecError) as e:
        load_spec(VARIANTS_YAML, clash)
    line = load_spec(VARIANTS_YAML).contracts["vllm_m3"].line
    assert e.value.errors == [f"{clash}:2: contracts.vllm_m3: already defined by variants.yaml:{line}; "
                              "give the new layout its own name"]
    with pytest.raises(SpecError, match=r"^1 error in the variant spec:\n/nowhere.yaml: cannot read"):
        load_spec(VARIANTS_YAML, "/nowhere.yaml")


def test_duplicate_family_names_across_files_are_reported(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text(HND.replace("  - name: user_hnd\n", "  - name: seed\n"))
    with pytest.raises(SpecError, match=rf"{dup}:\d+: families.seed: duplicate family name "
                                        r"\(first at variants.yaml:\d+\)"):
        load_spec(VARIANTS_YAML, dup)


def test_kvforge_variants_is_a_path_list():
    assert user_variant_files({}) == []
    assert user_variant_files({"KVFORGE_VARIANTS": f"a.yaml{os.pathsep}{os.pathsep}b.yaml"}) == [
        Path("a.yaml"), Path("b.yaml")]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvforge.codegen", *args], cwd="/", text=True,
                          capture_output=True, env={**os.environ, **(env or {})})


def test_the_cli_takes_the_file_by_flag_and_by_environment(hnd):
    by_flag = _cli("list", "--filter", "user_hnd_*", "--variants", str(hnd))
    by_env = _cli("list", "--filter", "user_hnd_*", env={"KVFORGE_VARIANTS": str(hnd)})
    assert by_flag.returncode == by_env.returncode == 0, by_flag.stderr + by_env.stderr
    assert by_flag.stdout == by_env.stdout and len(by_flag.stdout.split()) == 6
    assert f"+ {hnd}," in by_flag.stderr
    # generated/ holds the shipped variants only: an overlay never makes it stale
    assert _cli("check", "--variants", str(hnd)).returncode == 0


def test_the_registry_lists_an_added_file(hnd, monkeypatch):
    from kvforge.runtime import registry

    monkeypatch.setattr(registry, "_ADDED", [])
    registry.spec.cache_clear()
    registry.listed.cache_clear()
    try:
        registry.add_variants(hnd)
        assert "user_hnd" in registry.spec().contracts
        assert any(v.contract.name == "user_hnd" for v in registry.listed())
        bad = hnd.with_name("bad.yaml")
        bad.write_text("contracts: []\n")
        with pytest.raises(SpecError, match="bad.yaml:1: contracts: expected a mapping"):
            registry.add_variants(bad)
        assert registry._ADDED == [hnd]  # a file that does not parse changes nothing
    finally:
        registry.spec.cache_clear()
        registry.listed.cache_clear()


# The tests that read a contract's layout: the reference read back through the contract's
# expressions, validation and its messages, the bad-input table (fast tier); and the
# compile checks, whose samples hold every contract (slow tier: they compile).
CONTRACT_TESTS = ["tests/test_reference.py", "tests/test_api.py", "tests/test_bad_inputs.py"]
COMPILE_TESTS = ["tests/test_amd.py", "tests/test_build.py::test_variants_compile_for_sm90"]


@pytest.mark.parametrize("tests", [CONTRACT_TESTS, pytest.param(COMPILE_TESTS, marks=pytest.mark.slow)],
                         ids=["contract", "compile"])
def test_a_contract_only_in_yaml_passes_the_contract_tests(hnd, tests):
    """The CPU suite's contract tests, unedited, on a contract that only a user's file has."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rN", "-v", "-n", "0",
                           *tests], cwd=REPO, text=True, capture_output=True,
                          env={**os.environ, "KVFORGE_VARIANTS": str(hnd)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    if tests is COMPILE_TESTS:  # their ids name no variant: the cache shows what they built
        from kvforge.runtime.build import cache_root

        built = sorted(p.parent.parent.name for p in cache_root().glob("*/user_hnd_*/user_hnd_*")
                       if p.suffix in (".so", ".s"))
        assert built, "the compile checks built nothing of the new contract:\n" + proc.stdout[-3000:]
        return
    ran = [line for line in proc.stdout.splitlines() if "user_hnd" in line and "PASSED" in line]
    assert ran, "no test took the new contract:\n" + proc.stdout[-3000:]
