"""The request path, in rooms: `request/` (arguments, prompt, metrics), `chunks/` (which entry each chunk reads),
`prefill/` (the four prefill modes), `serving/` (the scheduler, batched decoding, streams), `corpus/` (precompute);
`engine.py` composes them into `CacheBlendEngine`."""

from ..models.fingerprint import model_fingerprint
from .corpus.groups import PrecomputePlan
from .engine import CacheBlendEngine
from .prefill.planning import RatioPolicy
from .prefill.prefiller import Prefill
from .request.metrics import RequestMetrics
from .request.prompt import QA_SHORT_TEMPLATE, PromptTemplate, TokenizedPrompt, tokenize_parts
from .request.request import Request, RequestOptions, SamplingParams
from .serving.decoding import AsyncTextStream, GenerationResult, TextStream

__all__ = [
    "QA_SHORT_TEMPLATE",
    "AsyncTextStream",
    "CacheBlendEngine",
    "GenerationResult",
    "Prefill",
    "PrecomputePlan",
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
