"""What TRL and transformers print on every run that says nothing to a user of this package, silenced where this
package's own code calls them (the config's construction, the trainer's construction and generation), never for the
whole process: the user's own warnings filters and loggers are left as they are.

- transformers 5 deprecates `gradient_checkpointing` for `activation_checkpointing`, and TRL 1.16 still uses the old
  names: its GRPOConfig default and its generation context warn on every run (`quiet_trl_deprecations`);
- DeepSpeed, when installed, guesses the accelerator at its first use and logs "Setting accelerator to CPU" where
  there is no GPU (`tell_deepspeed_the_cpu`);
- TRL's asynchronous trainer registers one callback class twice, and transformers logs the whole callback list
  (`quiet_duplicate_callback_notice`);
- tqdm's automatic bar warns in a notebook without ipywidgets (`progress_bar_class`, this package's own bars)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import warnings

import torch


TRL_DEPRECATIONS = r".*gradient_checkpointing.* is deprecated"
"""transformers' FutureWarning for the names TRL 1.16 still uses (`gradient_checkpointing`, `_enable`, `_disable`,
`is_gradient_checkpointing`)."""


@contextlib.contextmanager
def quiet_trl_deprecations():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRL_DEPRECATIONS, category=FutureWarning)
        yield


def tell_deepspeed_the_cpu() -> None:
    """Without a GPU, name the CPU as DeepSpeed's accelerator (unless the user named one), so that it does not guess
    and log its guess. Only where DeepSpeed would pick the CPU anyway."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


class _DuplicateCallbackNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("You are adding a ")


@contextlib.contextmanager
def quiet_duplicate_callback_notice():
    """transformers' "You are adding a <callback> ... there is already one" (with the list of every callback), which
    TRL's asynchronous trainer triggers itself by adding its interval callback twice, left out while it builds."""
    callback_logger = logging.getLogger("transformers.trainer_callback")
    notice = _DuplicateCallbackNotice()
    callback_logger.addFilter(notice)
    try:
        yield
    finally:
        callback_logger.removeFilter(notice)


def progress_bar_class():
    """tqdm's notebook bar where it can draw (ipywidgets installed), its text bar elsewhere: tqdm.auto alone warns
    "IProgress not found" in a notebook without ipywidgets before falling back to the text bar."""
    if importlib.util.find_spec("ipywidgets") is None:
        from tqdm import tqdm  # noqa: PLC0415 - the choice is the point

        return tqdm
    from tqdm.auto import tqdm  # noqa: PLC0415 - as above

    return tqdm
