"""Attention backends for packed variable-length windows, and the per-step metadata they share."""

from hf_blockbatch.attention.backends import BACKENDS, AttentionBackend, available_backends, get_backend
from hf_blockbatch.attention.metadata import WindowBatch, build_window_batch

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "WindowBatch",
    "available_backends",
    "build_window_batch",
    "get_backend",
]
