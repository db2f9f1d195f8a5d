"""The conversion of a GGUF file into a trainable folder (`trainable_folder`), described in
`topr_trl.inputs.packaged_models`: loaded only when a packaged model or a user's `.gguf` file is first resolved."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

from .packaged_models import CACHE_ENV, SOURCE_RECORD, ModelSourceError, cache_root


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
