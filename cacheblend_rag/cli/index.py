"""`cacheblend-rag index`: build and save a chunk index of a folder, or bring one saved before up to date."""

from __future__ import annotations

import argparse
import sys

from .args import check_model_name, check_numbers
from .sources import check_index_folder, choose_documents

__all__ = ["cmd_index"]


def cmd_index(args: argparse.Namespace) -> int:
    from ..models import load_model
    from ..retrieval import MIN_CHUNK_TOKENS, prepare_update

    # The documents first: a wrong path or encoding is reported before the model loads.
    check_numbers(("--chunk-tokens", args.chunk_tokens, MIN_CHUNK_TOKENS), ("--max-doc-mb", args.max_doc_mb, 0))
    check_model_name(args.model)
    check_index_folder(args.out, "--out")
    files, record = choose_documents(args)
    update = prepare_update(args.out, files, record)
    if update.problem is not None:
        print(f"the index in {args.out} cannot be reused ({update.problem}); rebuilding it from {args.docs}",
              file=sys.stderr)  # fmt: skip
    tokenizer = None
    if update.documents:  # the tokenizer only splits new and changed files
        _, tokenizer = load_model(args.model) if args.model else load_model()
    index = update.build(tokenizer, show_progress=True)
    print(update.summary(), file=sys.stderr)
    print(f"indexed {len(index)} chunks from {args.docs} into {args.out}")
    return 0
