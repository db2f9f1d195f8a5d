"""A tiny causal LM and character tokenizer built locally, for the built-in task, tests and benchmarks.

Nothing here touches the Hugging Face Hub: the tokenizer is trained with `tokenizers` on the task's own
alphabet and the model is a randomly initialised Qwen2 from a config (optionally warm-started by SFT).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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
        vocab_size=len(alphabet) + len(specials), special_tokens=specials, initial_alphabet=list(alphabet),
        show_progress=False,
    )
    tokenizer.train_from_iterator([alphabet], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_model(
    tokenizer: PreTrainedTokenizerFast, hidden_size: int = 64, num_layers: int = 2, seed: int = 0, **config_overrides
):
    """A randomly initialised Qwen2 causal LM sized for CPU tests (about 0.1M parameters at the defaults).
    `config_overrides` go to `Qwen2Config` (e.g. `initializer_range` for a more peaked random model)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_pretrained(model, tokenizer, path: str | Path) -> Path:
    """Save model and tokenizer so they load by path (GRPOTrainer reloads the reference model by name)."""
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
