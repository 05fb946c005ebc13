"""Attention backends: the small interface (`AttentionBackend`) and the implementations behind it."""

from dserve.attention.backend import AttentionBackend, ForwardBatch, create_backend

__all__ = ["AttentionBackend", "ForwardBatch", "create_backend"]
