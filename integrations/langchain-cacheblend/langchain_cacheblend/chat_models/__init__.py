"""Chat models."""

from .cacheblend import ChatCacheBlend, render_messages

__all__ = ["ChatCacheBlend", "render_messages"]
