"""`python -m kvforge.codegen [generate|check|list|compile]`.

generate (default)  regenerate generated/ from variants.yaml and include/kvforge/abi.h from
                    codegen/signature.py (write-if-different)
check               exit 1 if generated/ or abi.h is stale or a variants file is invalid
list                print the variants (optionally filtered)
compile             build every variant for the given targets (sm_XX with nvcc; gfxNNN
                    device code with clang's HIP mode) into the kernel cache, showing
                    progress; fail on any error or warning

--variants FILE (and KVFORGE_VARIANTS) lays a user's variants file over the shipped one:
its contracts and families join the list and the compile; generated/ holds only the
shipped variants (the others are rendered when built).
"""
from __future__ import annotations

if __package__ == "codegen":  # the old spelling, `python -m codegen` from a checkout's root
    import runpy
    runpy.run_module("kvforge.codegen", run_name="__main__", alter_sys=True)
    raise SystemExit(0)

import argparse
import os
import sys
import time

from .load import lay_over, load_spec
from .model import SpecError, Variant, select
from .paths import PACKAGE, VARIANTS_YAML, user_variant_files
from .render import generate, source_of
from .signature import ABI_HEADER, write_abi_header

_HEADER = ABI_HEADER.relative_to(PACKAGE).as_posix()


def _compile(variants: list[Variant], targets: list[str], jobs: int) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvforge.runtime import build, toolchain

    console = Console(stderr=True)
    failures = 0
    sources = [build.Job(v.uri, source_of(v)) for v in variants]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bar:
        for target in targets:
            start = time.monotonic()
            task = bar.add_task(target, total=len(variants))
            try:
                if target.startswith("gfx"):
                    tc = toolchain.amd_check(target)
                else:
                    tc = toolchain.detect(is_rocm=False, arch=target)
                root = build.cache_root()
                # Only a library whose record matches it counts (a damaged one is rebuilt).
                cached = sum(build.check_artifact(job.library(tc, root)) is None for job in sources)
                bar.update(task, completed=cached)

                def progress(built: int, line: str, task=task, cached=cached, target=target) -> None:
                    bar.update(task, completed=cached + built)
                    if not console.is_terminal:  # a log (CI): a line per library, as ninja's
                        console.print(f"{target}: [{cached + built}/{len(variants)}] {line}",
                                      highlight=False, soft_wrap=True)

                paths = build.build_many(sources, tc, root, parallel=jobs, progress=progress)
                # Counted only as verified now, against the record written at install.
                unverified = [f"{p}: {problem}" for p in paths if (problem := build.check_artifact(p))]
                count = len(paths) - len(unverified)
                if unverified:
                    raise build.BuildError("built but not verified:\n" + "\n".join(unverified))
            except Exception as e:  # report every target, then fail
                failures += 1
                console.print(f"{target}: FAILED: {e}", markup=False, highlight=False)
                continue
            console.print(f"{target}: {count}/{len(variants)} variants compiled "
                          f"({time.monotonic() - start:.1f} s)", highlight=False)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvforge.codegen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="generate",
                        choices=("generate", "check", "list", "compile"))
    parser.add_argument("--spec", default=str(VARIANTS_YAML), help="the shipped variant matrix")
    parser.add_argument("--variants", action="append", default=[], metavar="FILE",
                        help="a user's variants file laid over it (repeatable; after KVFORGE_VARIANTS's)")
    parser.add_argument("--filter", action="append", default=[], metavar="GLOB",
                        help="only variants whose name matches (repeatable)")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                        help="skip variants whose name matches (repeatable)")
    parser.add_argument("--target", default="sm_90",
                        help="compile: comma-separated targets, e.g. sm_90,gfx942,gfx950")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile: parallel jobs")
    args = parser.parse_args(argv)
    try:
        overlays = [*user_variant_files(), *args.variants]
        shipped = load_spec(args.spec)
        spec = lay_over(shipped, *overlays)
    except SpecError as e:
        print(e, file=sys.stderr)
        return 1
    if args.command == "list":
        chosen = select(spec.variants, args.filter, args.exclude)
        for v in chosen:
            print(v.uri)
        files = os.path.basename(args.spec) + "".join(f" + {f}" for f in overlays)
        print(f"{len(chosen)} variants ({len(spec.variants)} in {files}, "
              f"{len(spec.families)} families, {len(spec.contracts)} contracts)", file=sys.stderr)
        return 0
    if args.command == "check":
        header = write_abi_header(dry_run=True)
        report = generate(shipped, dry_run=True)
        if header or report.stale:
            if header:
                print(f"stale: {_HEADER}", file=sys.stderr)
            for name in report.written:
                print(f"stale: generated/{name}", file=sys.stderr)
            for name in report.removed:
                print(f"orphan: generated/{name}", file=sys.stderr)
            what = " and ".join(["generated/"] * bool(report.stale) + [_HEADER] * header)
            print(f"{what} {'are' if ' and ' in what else 'is'} out of date: run `python -m kvforge.codegen`",
                  file=sys.stderr)
            return 1
        print(f"generated/ ({len(shipped.variants)} variants) and {_HEADER} are current")
        return 0
    if args.command == "compile":
        chosen = select(spec.variants, args.filter, args.exclude)
        if write_abi_header(dry_run=True) or generate(shipped, dry_run=True).stale:
            print(f"generated/ or {_HEADER} is out of date: run `python -m kvforge.codegen` first", file=sys.stderr)
            return 1
        return _compile(chosen, [t.strip() for t in args.target.split(",") if t.strip()], args.jobs)
    header = write_abi_header()  # first: every source's input hash covers the headers
    report = generate(shipped)
    sources = [[name for name in names if name.endswith(".hip")]
               for names in (report.written, report.unchanged, report.removed)]
    print(f"{len(shipped.variants)} variants: {len(sources[0])} sources written, "
          f"{len(sources[1])} unchanged, {len(sources[2])} removed"
          + ("; manifest.json written" if "manifest.json" in report.written else "")
          + (f"; {_HEADER} written" if header else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # The reader went away (`python -m kvforge.codegen list | head`): stop quietly, as Unix
        # tools do; stdout goes to /dev/null so the interpreter's last flush fails no more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
