from . import transforms  # noqa: F401  (registration)
