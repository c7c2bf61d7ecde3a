"""An example third-party loongkit plugin."""

__version__ = "0.1.0"
