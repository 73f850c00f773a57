"""kvforge code generator: variants.yaml → generated/*.hip (`python -m kvforge.codegen`)."""
__version__ = "0.1.0"
