from . import dense_heads, detectors, modules  # noqa: F401  (registration)
