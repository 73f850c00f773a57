"""`python -m kvforge.codegen [generate|check|list|compile]`.

generate (default)  regenerate generated/ from variants.yaml (write-if-different)
check               exit 1 if generated/ is stale or variants.yaml is invalid
list                print the variants (optionally filtered)
compile             build every generated variant for the given targets (sm_XX with
                    nvcc; gfxNNN device code with clang's HIP mode), fail on any
                    error or warning, print how many compiled per target
"""
from __future__ import annotations

if __package__ == "codegen":  # the old spelling, `python -m codegen` from a checkout's root
    import runpy
    runpy.run_module("kvforge.codegen", run_name="__main__", alter_sys=True)
    raise SystemExit(0)

import argparse
import fnmatch
import os
import sys
import time

from .model import SpecError, Variant, load_spec
from .paths import GENERATED, VARIANTS_YAML
from .render import generate


def _select(variants, include: list[str], exclude: list[str]) -> list[Variant]:
    """CUTLASS-style filters: glob patterns over the procedural names."""
    out = []
    for v in variants:
        if include and not any(fnmatch.fnmatch(v.uri, p) for p in include):
            continue
        if any(fnmatch.fnmatch(v.uri, p) for p in exclude):
            continue
        out.append(v)
    return out


def _compile(variants: list[Variant], targets: list[str], jobs: int) -> int:
    from kvforge.runtime import build, toolchain

    failures = 0
    for target in targets:
        start = time.monotonic()
        try:
            if target.startswith("gfx"):
                tc = toolchain.amd_check(target)
            else:
                tc = toolchain.detect(is_rocm=False, arch=target)
            job_list = [build.Job(v.uri, (GENERATED / f"{v.uri}.hip").read_text()) for v in variants]
            count = len(build.build_many(job_list, tc, parallel=jobs))
        except Exception as e:  # report every target, then fail
            failures += 1
            print(f"{target}: FAILED: {e}", file=sys.stderr)
            continue
        print(f"{target}: {count}/{len(variants)} variants compiled ({time.monotonic() - start:.1f} s)")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvforge.codegen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="generate",
                        choices=("generate", "check", "list", "compile"))
    parser.add_argument("--spec", default=str(VARIANTS_YAML), help="the variant matrix")
    parser.add_argument("--filter", action="append", default=[], metavar="GLOB",
                        help="only variants whose name matches (repeatable)")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                        help="skip variants whose name matches (repeatable)")
    parser.add_argument("--target", default="sm_90",
                        help="compile: comma-separated targets, e.g. sm_90,gfx942,gfx950")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile: parallel jobs")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        print(e, file=sys.stderr)
        return 1
    if args.command == "list":
        chosen = _select(spec.variants, args.filter, args.exclude)
        for v in chosen:
            print(v.uri)
        print(f"{len(chosen)} variants ({len(spec.variants)} in {os.path.basename(args.spec)}, "
              f"{len(spec.families)} families, {len(spec.contracts)} contracts)", file=sys.stderr)
        return 0
    if args.command == "check":
        report = generate(spec, dry_run=True)
        if report.stale:
            for name in report.written:
                print(f"stale: generated/{name}", file=sys.stderr)
            for name in report.removed:
                print(f"orphan: generated/{name}", file=sys.stderr)
            print("generated/ is out of date: run `python -m kvforge.codegen`", file=sys.stderr)
            return 1
        print(f"generated/ is current ({len(spec.variants)} variants)")
        return 0
    if args.command == "compile":
        chosen = _select(spec.variants, args.filter, args.exclude)
        stale = generate(spec, dry_run=True).stale
        if stale:
            print("generated/ is out of date: run `python -m kvforge.codegen` first", file=sys.stderr)
            return 1
        return _compile(chosen, [t.strip() for t in args.target.split(",") if t.strip()], args.jobs)
    report = generate(spec)
    print(f"{len(report.written)} written, {len(report.unchanged)} unchanged, "
          f"{len(report.removed)} removed ({len(spec.variants)} variants)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # The reader went away (`python -m kvforge.codegen list | head`): stop quietly, as Unix
        # tools do; stdout goes to /dev/null so the interpreter's last flush fails no more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
