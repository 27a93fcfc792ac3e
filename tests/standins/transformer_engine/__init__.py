"""STAND-IN for NVIDIA Transformer Engine's API surface (see tests/standins/README.md). Not Transformer Engine."""

STANDIN = True
__version__ = "0+standin"
