"""loongkit-precision plugin."""

__version__ = "0.1.0"
