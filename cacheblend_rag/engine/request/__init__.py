"""One request, before any compute: its checked arguments (`request`), its tokenized prompt (`prompt`, with the
chat template's markup kept apart from content: `marked_text`), what it cost (`metrics`), and the token ids of the
chunks retrieved before (`token_cache`)."""
