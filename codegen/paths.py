"""Where the package's data lives: beside the code, in a checkout and in an installed wheel
alike (pyproject maps the checkout's root onto the package `kvforge`)."""
import os
from pathlib import Path
from typing import Mapping

PACKAGE = Path(__file__).resolve().parent.parent
VARIANTS_YAML = PACKAGE / "variants.yaml"
TEMPLATES = PACKAGE / "templates"
INCLUDE = PACKAGE / "include"
GENERATED = PACKAGE / "generated"
TUNED = PACKAGE / "tuning"  # launch choices the tuner measured (runtime/tuning.py)


def user_variant_files(env: Mapping[str, str] = os.environ) -> list[Path]:
    """KVFORGE_VARIANTS: variants files (separated by os.pathsep) laid over the shipped one,
    so an engine adds contracts and families without editing the installed package."""
    return [Path(p) for p in env.get("KVFORGE_VARIANTS", "").split(os.pathsep) if p]
