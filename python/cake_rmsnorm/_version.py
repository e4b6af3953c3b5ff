"""The package version: the one place it is stated (pyproject reads it from here)."""

__version__ = "0.1.0"
