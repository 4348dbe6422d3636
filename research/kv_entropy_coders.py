"""Can a coder other than zstd with a frame per group of component ranks take `pca` codes nearer their entropy, at a
decoding speed the loading pipeline can hide? (study 35, the last step to 6 bits per corpus value)

    python research/kv_entropy_coders.py /tmp/kv.pt [--spec k4v2:p:0.0028:0.0028] [--entries 30]

On entries collected by `kv_transform_codec.py collect`, every fourth one coded (from the first), every fourth one
from the second fitting what a coder may learn beforehand: bits per value of
- `groups`: zstd, a frame per group of component ranks (the product's layout);
- `spread`: zstd, a frame per class of the components' spread (their codes' std on the fitting entries, classes an
  octave wide), so that each frame's Huffman table fits components of one width;
- `dictionary`: the product's frames, each compressed with a zstd dictionary trained per (layer, kind, group) on the
  fitting entries (tables learnt once instead of sent in every frame);
- `ans`: constriction's ANS coder (when installed) with a fixed table per (layer, kind, head, component) from the
  fitting entries, and its decoding speed against zstd's, in values per second on this CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_transform_codec as study  # noqa: E402

from cacheblend_rag.store.transform_codec import component_groups  # noqa: E402

_ZSTD = zstandard.ZstdCompressor(level=3)


def zstd_bytes(a: np.ndarray) -> int:
    return len(_ZSTD.compress(np.ascontiguousarray(a).tobytes()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("entries_file")
    p.add_argument("--spec", default="k4v2:p:0.0028:0.0028", help="NAME:p:REL_MSE_KEYS:REL_MSE_VALUES")
    p.add_argument("--entries", type=int, default=30)
    p.add_argument("--layers", type=int, default=0, help="the first N layers only (0: all)")
    args = p.parse_args()
    name, kind_of, rk, rv = args.spec.split(":")
    codec = study.Lossy(name, study.fit(kind_of, float(rk), float(rv)))
    data = torch.load(args.entries_file)
    coded, fitting = data[::4][: args.entries], data[1::4][: args.entries]
    num_layers = args.layers or coded[0][2].shape[0]
    groups = component_groups(coded[0][2].shape[-1])
    try:
        import constriction
    except ImportError:
        constriction = None

    def codes(entry: tuple, layer: int, kind: int) -> np.ndarray:  # int8 [H, D, T], ranks from the largest
        c = torch.stack(codec.codes(entry[2 + kind][layer], layer, kind)).flip(-1).transpose(1, 2)
        return c.clamp(-127, 127).to(torch.int8).numpy()

    total = dict.fromkeys(("groups", "spread", "dictionary", "ans"), 0)
    n = 0
    seconds = {"zstd": 0.0, "ans": 0.0}
    for layer in range(num_layers):
        for kind in (0, 1):
            fit = np.concatenate([codes(e, layer, kind) for e in fitting], axis=-1)  # [H, D, sum T]
            classes = np.floor(np.log2(fit.astype(np.float32).std(-1) + 0.25)).astype(int)  # [H, D]
            tables = {}
            for a, b in groups:
                samples = [np.ascontiguousarray(codes(e, layer, kind)[:, a:b]).tobytes() for e in fitting]
                trained = zstandard.train_dictionary(2048, samples * 4, level=3)
                tables[a, b] = zstandard.ZstdCompressor(level=3, dict_data=trained, write_dict_id=False)
            if constriction is not None:
                models = {}
                for h in range(fit.shape[0]):
                    for d in range(fit.shape[1]):
                        counts = np.bincount(fit[h, d].astype(np.int64) + 127, minlength=255) + 0.01
                        models[h, d] = constriction.stream.model.Categorical(
                            (counts / counts.sum()).astype(np.float32), perfect=False
                        )
            for entry in coded:
                c = codes(entry, layer, kind)
                n += c.size
                total["groups"] += sum(zstd_bytes(c[:, a:b]) for a, b in groups)
                total["spread"] += sum(zstd_bytes(c[classes == v]) for v in np.unique(classes))
                total["dictionary"] += sum(len(tables[a, b].compress(c[:, a:b].tobytes())) for a, b in groups)
                if constriction is None:
                    continue
                frames = [zstandard.ZstdCompressor(level=3).compress(c[:, a:b].tobytes()) for a, b in groups]
                t = time.perf_counter()
                for frame in frames:
                    zstandard.ZstdDecompressor().decompress(frame)
                seconds["zstd"] += time.perf_counter() - t
                coder = constriction.stream.stack.AnsCoder()
                for h in reversed(range(c.shape[0])):
                    for d in reversed(range(c.shape[1])):
                        coder.encode_reverse(c[h, d].astype(np.int32) + 127, models[h, d])
                compressed = coder.get_compressed()
                total["ans"] += compressed.nbytes
                t = time.perf_counter()
                decoder = constriction.stream.stack.AnsCoder(compressed)
                out = np.empty(c.shape, np.int32)
                for h in range(c.shape[0]):
                    for d in range(c.shape[1]):
                        out[h, d] = decoder.decode(models[h, d], c.shape[2])
                seconds["ans"] += time.perf_counter() - t
                assert np.array_equal(out - 127, c), "ANS round trip"
    print(f"{name}, {len(coded)} entries, {num_layers} layers: bits per value")
    for coder, nbytes in total.items():
        if coder != "ans" or constriction is not None:
            print(f"  {coder:<11} {8 * nbytes / n:.3f}")
    if constriction is not None:
        rates = {coder: n / s / 1e6 for coder, s in seconds.items()}
        print(f"decoding: zstd {rates['zstd']:.0f} M values/s, ANS {rates['ans']:.0f} M values/s")
    else:
        print("ANS: constriction is not installed (pip install constriction)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
