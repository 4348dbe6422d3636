"""Callback handlers."""

from .metrics import CacheBlendMetricsHandler, CallRecord

__all__ = ["CacheBlendMetricsHandler", "CallRecord"]
