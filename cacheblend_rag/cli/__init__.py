"""Command line: `cacheblend-rag ask --docs DIR "question"` and friends.

One module per command (`ask`, `calibrate`, `profile`, `index`, `plan`, `models`, `env`); the parser and the checks
shared by the commands are in `args`, where `ask`, `calibrate` and `index` get their chunks in `sources`. Importing this
package loads no model machinery: every command imports torch, transformers or FAISS when it runs.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence

from ..advice import cli_option_names
from ..errors import CacheBlendError
from .args import build_parser
from .ask import cmd_ask
from .calibrate import cmd_calibrate
from .env import cmd_env
from .index import cmd_index
from .models import cmd_models
from .plan import cmd_plan
from .profile import cmd_profile

__all__ = ["COMMANDS", "build_parser", "main"]


COMMANDS = {
    "ask": cmd_ask,
    "calibrate": cmd_calibrate,
    "profile": cmd_profile,
    "index": cmd_index,
    "models": cmd_models,
    "plan": cmd_plan,
    "env": cmd_env,
}


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # A file name that is not valid UTF-8 reaches Python as lone surrogates: print it escaped, not crash.
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        with cli_option_names():  # advice names --flags, not Python arguments
            return COMMANDS[args.command](args)
    except CacheBlendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (128 + SIGINT, as shells report it)
        sys.stdout.flush()
        print("interrupted", file=sys.stderr, flush=True)
        return 130
