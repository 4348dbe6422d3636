"""The pieces of decoding that know tokens and text: which token comes next, and what text is safe to show.

`TokenPicker` picks a token from the logits (argmax, or sampling warped by a request's `SamplingParams`), and
`greedy_tokens` the greedy requests' tokens of a batched step at once;
`TextAssembler` turns token ids into text deltas cut at a stop string; `eos_token_ids` names the tokens that end
a turn. The loop that drives them, step by step, is `decoding.TokenLoop`; the checks of the settings they read
are in `request`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

if TYPE_CHECKING:
    from ..request.request import SamplingParams


class TokenPicker:
    """Chooses the next token from logits: argmax when greedy, else warped sampling with its own RNG."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.greedy = params.temperature == 0
        self.warpers = LogitsProcessorList()
        if not self.greedy:
            self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1:
                self.warpers.append(TopPLogitsWarper(params.top_p))
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        """logits: [vocab] float32"""
        if self.greedy:
            return int(torch.argmax(logits))
        ids = torch.tensor([list(generated)], dtype=torch.long, device=logits.device)
        scores = self.warpers(ids, logits.unsqueeze(0))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator)[0, 0])


def greedy_tokens(logits: torch.Tensor, greedy: Sequence[bool]) -> dict[int, int]:
    """The argmax of each greedy row of a step's logits [B, vocab] (row -> token), in one operation and one read back
    for the whole batch: on a GPU one kernel and one wait per step, where a pick per request cost one each. Ties go
    to the lowest token id, as `torch.argmax` of the row alone gives."""
    rows = [i for i, g in enumerate(greedy) if g]
    if not rows:
        return {}
    picked = logits if len(rows) == logits.shape[0] else logits[rows]
    return dict(zip(rows, picked.argmax(-1).tolist(), strict=True))


class TextAssembler:
    """Turns generated token ids into text deltas, cut at the first stop string.

    Text is held back while it ends in an incomplete UTF-8 sequence or in what could be the start of a stop
    string, so a streamed answer never shows text that the final answer does not contain.
    """

    def __init__(self, tokenizer, stop: Iterable[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # final text so far (without any stop string)
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Add a token; return the newly safe text (may be empty)."""
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = full[:cut], True
            return self._emit(len(self.text))
        self.text = full
        safe = len(full)
        if full.endswith("\ufffd"):
            safe = len(full.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that may grow into a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if full[:safe].endswith(s[:k]):
                    safe -= k
                    break
        return self._emit(safe)

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta


def eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return ids
