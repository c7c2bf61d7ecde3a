from . import bbox  # noqa: F401  (registration)
