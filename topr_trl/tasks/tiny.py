"""A tiny causal LM and character tokenizer built locally, for the built-in task, tests and benchmarks.

Nothing here touches the Hugging Face Hub: the tokenizer is trained with `tokenizers` on the task's own
alphabet and the model is a randomly initialised Llama-architecture model from a config (optionally warm-started by
SFT).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import string
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

from ..runtime.machine import machine_info


BOS, EOS, PAD = "<|im_start|>", "<|im_end|>", "<pad>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(alphabet: str = string.printable) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` plus the chat special tokens, with a ChatML chat template.

    Trained with a BPE trainer whose vocabulary is capped at the alphabet, so no merges are learnt: digits stay
    single tokens, which keeps arithmetic learnable by a tiny model.
    """
    alphabet = "".join(sorted(set(alphabet)))
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    specials = [PAD, BOS, EOS]
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(specials),
        special_tokens=specials,
        initial_alphabet=list(alphabet),
        show_progress=False,
    )
    tokenizer.train_from_iterator([alphabet], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


HEAD_DIM = 32
"""The tiny models' attention head size: vLLM's CPU attention kernel refuses 16 (the size before), and 32 is the
smallest it runs. Part of the built-in models' keys (`topr_trl.tasks.arithmetic.warm_model_key`,
`topr_trl.tasks.reasoning.WarmStartSettings`), so a model cached with another head size is never loaded as this one."""


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
    **config_overrides,
):
    """A randomly initialised Llama-architecture (Mistral) causal LM sized for CPU tests (about 0.1M parameters
    at the defaults): `hidden_size // head_dim` attention heads (at least one) of `head_dim`, half as many key-value
    heads (grouped-query attention, as Llama 3 and Qwen2.5 use). `config_overrides` go to `MistralConfig` (e.g.
    `initializer_range` for a more peaked random model)."""
    torch.manual_seed(seed)
    heads = max(1, hidden_size // head_dim)
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    model = MistralForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_pretrained(model, tokenizer, path: str | Path) -> Path:
    """Save model and tokenizer so they load by path (GRPOTrainer reloads the reference model by name)."""
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # AutoTokenizer must rebuild exactly this tokenizer, not a model-specific class with its own pre-tokenizer
    # (why the tiny model is a Mistral: transformers maps Qwen2 checkpoints to Qwen2Tokenizer regardless).
    config_file = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(tokenizer_config, indent=2))
    return path


# ---------------------------------------------------------------------------------------------------------
# Built-in models shipped as weights
# ---------------------------------------------------------------------------------------------------------
# The built-in tasks' warm starts (thousands of AdamW steps at a high learning rate) amplify the last-bit differences
# between CPU kernels: the same seed trained with 1 or 2 threads, or with AVX2 or AVX-512 kernels, gives weights
# several percent apart, and a base model whose quality differs from machine to machine. Bitwise-equal training
# across kernels cannot be had from torch, so the models of the default settings are shipped as weights, built
# once (`experiments/build_prebuilt_models.py`), and identical on every machine; other settings are built locally and
# cached under a key that names the torch version, the CPU kernels and the thread count that made them.
PREBUILT_DIR = Path(__file__).parent / "prebuilt"
BUILD_FILE = "build.json"


def machine_key() -> str:
    """What changes a locally trained model besides its settings: torch version, CPU kernels, threads."""
    capability = torch.backends.cpu.get_cpu_capability()
    key = f"torch{torch.__version__}-{capability}-t{torch.get_num_threads()}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", key).lower()


def prebuilt_model(key: str) -> Path | None:
    """The shipped model of `key`, or None when the settings of `key` are not shipped."""
    folder = PREBUILT_DIR / key
    return folder if (folder / "config.json").is_file() else None


@contextlib.contextmanager
def staged_folder(destination: str | Path) -> Iterator[Path]:
    """A new folder of this process's own beside `destination`, to write a model into; renamed to `destination`
    when the block ends without an error, removed otherwise. A reader never sees half a model, and two processes
    making the same model at once (two runs, one per core, sharing a cache folder) never write into or rename each
    other's folder: the first to finish publishes its copy, the other's is dropped (the same settings make the same
    model)."""
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{destination.name}.partial-", dir=destination.parent))
    staging.chmod(0o755)  # mkdtemp's folder is private; a cache folder is not
    try:
        yield staging
        try:
            staging.rename(destination)
        except OSError:
            if not (destination / "config.json").is_file():  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def install_prebuilt(key: str, destination: str | Path) -> bool:
    """Copy the shipped model of `key` to `destination` (the cache folder); False when none is shipped."""
    source = prebuilt_model(key)
    if source is None:
        return False
    with staged_folder(destination) as staging:
        shutil.copytree(source, staging, dirs_exist_ok=True)
    return True


def record_build(path: str | Path, settings: dict, **extra) -> None:
    """Write what made the model in `path`: its settings and the machine (README.md, "What to expect")."""
    record = {"settings": settings, "machine": machine_info(), **extra}
    (Path(path) / BUILD_FILE).write_text(json.dumps(record, indent=2))
