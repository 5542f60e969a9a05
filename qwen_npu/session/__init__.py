"""The Session: the stateful facade a notebook drives (requests, steps, inspection, forks, close)."""
from .session import Session  # noqa: F401
