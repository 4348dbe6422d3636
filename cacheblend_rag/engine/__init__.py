"""The request path: prompts made of chunks, the four prefill modes, decoding and per-request metrics."""

from ..models.fingerprint import model_fingerprint
from .decoding import AsyncTextStream, GenerationResult, TextStream
from .engine import CacheBlendEngine
from .metrics import RequestMetrics
from .planning import RatioPolicy
from .prefill import Prefill
from .prompt import QA_SHORT_TEMPLATE, PromptTemplate, TokenizedPrompt, tokenize_parts
from .request import Request, RequestOptions, SamplingParams

__all__ = [
    "QA_SHORT_TEMPLATE",
    "AsyncTextStream",
    "CacheBlendEngine",
    "GenerationResult",
    "Prefill",
    "PromptTemplate",
    "RatioPolicy",
    "RequestMetrics",
    "Request",
    "RequestOptions",
    "SamplingParams",
    "TextStream",
    "TokenizedPrompt",
    "model_fingerprint",
    "tokenize_parts",
]
