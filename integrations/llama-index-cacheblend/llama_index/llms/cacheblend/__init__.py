"""LlamaIndex LLM on a cacheblend-rag engine: `CacheBlendLLM`."""

from llama_index.llms.cacheblend.base import METRICS_KEY, CacheBlendLLM

__all__ = ["METRICS_KEY", "CacheBlendLLM"]
