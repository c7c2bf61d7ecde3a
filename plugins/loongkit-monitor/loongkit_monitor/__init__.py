"""loongkit-monitor plugin: LOONGKIT_MONITOR, an observe-only view of the user's training job."""

__version__ = "0.1.0"
