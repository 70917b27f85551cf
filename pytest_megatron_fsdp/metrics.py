"""The documented import path of the metrics API (``reporting.metrics``). Imports no torch."""

from .reporting.metrics import checkpoint_size_bytes, record_checkpoint, run_records

__all__ = ["checkpoint_size_bytes", "record_checkpoint", "run_records"]
