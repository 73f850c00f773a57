"""Where the project's inputs and outputs live (relative to this checkout)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS_YAML = ROOT / "variants.yaml"
TEMPLATES = ROOT / "templates"
INCLUDE = ROOT / "include"
GENERATED = ROOT / "generated"
TUNED = ROOT / "tuning"  # launch choices the tuner measured (runtime/tuning.py)
