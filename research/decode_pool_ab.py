"""The decode slot pool as it was against as it is, in one process, on the default model: a lone request's decoding.

Before: the pool zeroed every slot when it was made (four for a lone request) and, on a CPU, ran attention as two
products, a scale, a mask and a softmax. Now: the pool's memory is left unwritten until a slot is given out (which
zeroes only what it does not fill), and attention is torch's fused kernel on every device. `OldPool` below is the
old behaviour over today's pool, swapped in for the engine's; rounds alternate which goes first.

Two measures:
- speed: a warm blend (6 x 512-token chunks, 3,143 tokens) answered with 128 tokens, `decode_weights="int8"`,
  decode tokens/s and time to the last token, per round (the request's pool is made and let go each time);
- fidelity (`--kl N`): on N prompts of about 790 tokens, the model's own greedy decode (its forward with a
  `DynamicCache`, native weights) along 96 tokens is the reference; each pool's int8 decode steps, teacher-forced
  on the same tokens, are scored by the mean KL(model || pool) and top-1 agreement (`--native-weights`: the
  steps run the model's own weights, which shows the two attentions' rounding alone).

    python research/decode_pool_ab.py --dtype bfloat16 --rounds 6
    python research/decode_pool_ab.py --dtype float32 --rounds 4 --kl 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from benchlib.cli import cpu_name  # noqa: E402
from benchlib.load_requests import QUESTIONS  # noqa: E402
from benchlib.timing import chunk_texts  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig, ServingConfig  # noqa: E402
from cacheblend_rag.engine.serving import decode_slots  # noqa: E402
from cacheblend_rag.engine.serving.batch_decode import BatchDecoder  # noqa: E402
from cacheblend_rag.engine.serving.slots import SlotPool  # noqa: E402
from cacheblend_rag.models.int8 import int8_decode_lm  # noqa: E402


class OldPool(SlotPool):
    """The pool as it was on a CPU: zeroed whole when made, attention as products."""

    def _empty(self, slots: int, capacity: int) -> torch.Tensor:
        s = self.shape
        return torch.zeros(s.num_layers, slots, s.num_kv_heads, capacity, s.head_dim, dtype=self.dtype,
                           device=self.device)  # fmt: skip

    def _clear_tail(self, slots, start: int) -> None:
        pass  # everything was zero already

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor:  # fmt: skip
        s = self.shape
        hi, groups = q.shape[0], s.num_heads // s.num_kv_heads
        scores = torch.matmul(q.view(hi, s.num_kv_heads, groups, s.head_dim), keys.transpose(2, 3))
        scores = scores.mul_(scale).masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.matmul(probs, values)


POOLS = {"before": OldPool, "now": SlotPool}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def speed(engine: CacheBlendEngine, rounds: int, new_tokens: int) -> None:
    chunks = chunk_texts(engine.tokenizer, 6, 512, Path("../shared/data"))
    engine.generate(chunks, QUESTIONS[0], max_new_tokens=8)  # warm: chunk KV stored, kernels loaded
    runs: dict[str, list[dict]] = {name: [] for name in POOLS}
    answers: dict[tuple[int, str], list[int]] = {}
    for rnd in range(rounds):
        order = list(POOLS) if rnd % 2 == 0 else list(POOLS)[::-1]
        for name in order:
            decode_slots.SlotPool = POOLS[name]  # what the engine's decode slots make their pool from
            r = engine.generate(chunks, QUESTIONS[rnd % 3], max_new_tokens=new_tokens, stop=[])
            m = r.metrics
            answers[(rnd, name)] = r.token_ids
            runs[name].append(dict(tokens_per_s=(m.generated_tokens - 1) / m.decode_s, decode_s=m.decode_s,
                                   last_token_s=m.ttft_s + m.decode_s, ttft_s=m.ttft_s))  # fmt: skip
    decode_slots.SlotPool = SlotPool
    same = [first_difference(answers[(r, "before")], answers[(r, "now")]) for r in range(rounds)]
    print(f"tokens alike before the first difference, per round: {same} of {new_tokens}")
    for key in ("tokens_per_s", "decode_s", "last_token_s", "ttft_s"):
        b = [x[key] for x in runs["before"]]
        a = [x[key] for x in runs["now"]]
        ratios = [round(x / y, 3) for x, y in zip(a, b, strict=True)]
        print(f"{key:13s} before {statistics.median(b):7.3f}  now {statistics.median(a):7.3f}  now/before {ratios}")


def kl(engine: CacheBlendEngine, dtype: torch.dtype, prompts: int = 3, native: bool = False, steps: int = 96) -> None:
    tok, model = engine.tokenizer, engine.model
    pool_of_chunks = chunk_texts(tok, 3 * prompts, 256, Path("../shared/data"))
    decoder = BatchDecoder(engine.lm if native else int8_decode_lm(model))
    weights = "native" if native else "int8"
    scores: dict[str, list[tuple[float, int]]] = {name: [] for name in POOLS}
    for case in range(prompts):
        text = " ".join(pool_of_chunks[3 * case : 3 * case + 3]) + " Question: " + QUESTIONS[case % len(QUESTIONS)]
        ids = torch.tensor([tok.encode(text)])
        with torch.inference_mode():
            cache, prompt = DynamicCache(config=model.config), DynamicCache(config=model.config)
            out = model(ids, cache=cache, use_cache=True)
            model(ids, cache=prompt, use_cache=True)  # the prompt's KV alone, for the pools
            reference, tokens = [], []
            token = out.logits[0, -1].argmax()
            for _ in range(steps):
                tokens.append(int(token))
                o = model(token.view(1, 1), cache=cache, use_cache=True)
                reference.append(o.logits[0, -1].float())
                token = o.logits[0, -1].argmax()
        keys = [layer.keys[0] for layer in prompt.layers]
        values = [layer.values[0] for layer in prompt.layers]
        n = ids.shape[1]
        for name, cls in POOLS.items():
            pool = cls(engine.lm.shape, dtype, "cpu", slots=1, capacity=n + steps + 8)
            slot = pool.admit(keys, values, n, steps + 4)
            for want, t in zip(reference, tokens, strict=True):
                got = decoder.step_slots([t], pool, [slot])[0].float()
                p, q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
                scores[name].append((float((p.exp() * (p - q)).sum()), int(got.argmax() == want.argmax())))
    for name, rows in scores.items():
        kls = [k for k, _ in rows]
        top1 = sum(a for _, a in rows)
        print(f"{name}: {weights} steps against the model's own decode ({prompts} prompts of ~790 tokens, {len(rows)} "
              f"steps): mean KL {statistics.mean(kls):.2e} (max {max(kls):.2e}), top-1 {top1}/{len(rows)}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--kl", type=int, default=0, metavar="PROMPTS", help="teacher-forced fidelity on PROMPTS")
    p.add_argument("--native-weights", action="store_true", help="score steps with the model's weights, not int8")
    args = p.parse_args()
    torch.set_num_threads(2)
    engine = CacheBlendEngine.from_pretrained(
        None, config=EngineConfig(serving=ServingConfig(decode_weights="int8"), dtype=args.dtype), show_progress=False
    )
    print(f"{cpu_name()}, dtype {args.dtype}, 2 threads")
    if args.rounds:
        speed(engine, args.rounds, args.new_tokens)
    if args.kl:
        kl(engine, getattr(torch, args.dtype), args.kl, args.native_weights)


if __name__ == "__main__":
    main()
