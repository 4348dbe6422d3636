"""The request path: prompts made of chunks, the four prefill modes, decoding and per-request metrics."""

from .engine import CacheBlendEngine, GenerationResult, Prefill, TextStream, model_fingerprint
from .generation import SamplingParams
from .metrics import RequestMetrics
from .prompt import QA_SHORT_TEMPLATE, PromptTemplate, TokenizedPrompt, tokenize_parts

__all__ = [
    "QA_SHORT_TEMPLATE",
    "CacheBlendEngine",
    "GenerationResult",
    "Prefill",
    "PromptTemplate",
    "RequestMetrics",
    "SamplingParams",
    "TextStream",
    "TokenizedPrompt",
    "model_fingerprint",
    "tokenize_parts",
]
