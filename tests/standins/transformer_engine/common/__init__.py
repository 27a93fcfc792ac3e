"""STAND-IN (see tests/standins/README.md)."""
