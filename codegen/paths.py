"""Where the package's data lives: beside the code, in a checkout and in an installed wheel
alike (pyproject maps the checkout's root onto the package `kvforge`)."""
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent
VARIANTS_YAML = PACKAGE / "variants.yaml"
TEMPLATES = PACKAGE / "templates"
INCLUDE = PACKAGE / "include"
GENERATED = PACKAGE / "generated"
TUNED = PACKAGE / "tuning"  # launch choices the tuner measured (runtime/tuning.py)
