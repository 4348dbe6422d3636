"""`cacheblend-rag index`: build and save a chunk index of a folder."""

from __future__ import annotations

import argparse

from .args import check_model_name, check_numbers
from .sources import build_index, check_index_folder, choose_documents

__all__ = ["cmd_index"]


def cmd_index(args: argparse.Namespace) -> int:
    from ..models import load_model
    from ..retrieval import MIN_CHUNK_TOKENS, read_documents

    # The documents first: a wrong path or encoding is reported before the model loads.
    check_numbers(("--chunk-tokens", args.chunk_tokens, MIN_CHUNK_TOKENS), ("--max-doc-mb", args.max_doc_mb, 0))
    check_model_name(args.model)
    check_index_folder(args.out, "--out")
    files, record = choose_documents(args)
    documents = read_documents(files, encoding=args.encoding)
    _, tokenizer = load_model(args.model) if args.model else load_model()
    index = build_index(args, documents, tokenizer, record, args.out)
    print(f"indexed {len(index)} chunks from {args.docs} into {args.out}")
    return 0
