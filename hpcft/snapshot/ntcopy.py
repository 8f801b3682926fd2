"""Moved to hpcft.store.ntcopy; this name stays only until hpcft/doctor.py imports it from there."""
from hpcft.store.ntcopy import probe  # noqa: F401
