"""Completion (text-in, text-out) models."""

from .cacheblend import CacheBlendLLM

__all__ = ["CacheBlendLLM"]
