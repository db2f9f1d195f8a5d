"""What a run reaches outside its own process, checked before anything loads so that a run that cannot reach it
fails in one line rather than after the model has loaded (or hours of training): a `--report_to` tracker's package,
the Hugging Face Hub and a token for `--push_to_hub`, a vLLM server the trainer can push weights into; and a push
that fails after training, which says where the saved model is."""

from __future__ import annotations

import contextlib
from pathlib import Path

from huggingface_hub import get_token
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

from ..generation.vllm_server import BACKEND
from ..generation.vllm_server.client import server_url, server_weight_backend
from ..inputs.sources import hub_unreachable_reason
from ..runtime.distributed import gpu_available
from .output_folders import shown_path


# What to `pip install` for a `--report_to` tracker whose package is not named as the tracker is.
_TRACKER_PACKAGES = {"comet_ml": "comet-ml", "azure_ml": "azureml-core", "flyte": "flytekit"}


def check_trackers(report_to) -> None:
    """Fail in one line on a `--report_to` tracker that is unknown or not installed (transformers would raise a
    traceback when the trainer is built, after the model has loaded): checked at configuration, dry runs included.
    Which trackers exist and which are installed is transformers' own answer."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise SystemExit(
                f"topr-trl: --report_to {name}: unknown tracker; choose among none, "
                f"{', '.join(INTEGRATION_TO_CALLBACK)}"
            )
        if name not in get_available_reporting_integrations():
            package = _TRACKER_PACKAGES.get(name, name)
            raise SystemExit(
                f"topr-trl: --report_to {name} needs the `{package}` package, which is not installed: "
                f"pip install {package} (or choose --report_to tensorboard, installed with topr-trl, or "
                "none)"
            )


def check_vllm_server_mode(training_args) -> None:
    """`--use_vllm true --vllm_mode server` fails before anything loads, in one line, when the server cannot follow the
    policy: unreachable, or without a weight path this machine can drive. TRL pushes weights into a server by NCCL
    (CUDA only); `topr-trl vllm-serve` runs a gloo path too, the default without a GPU."""
    if not (training_args.use_vllm and training_args.vllm_mode == "server"):
        return

    url = server_url(training_args)
    backend = server_weight_backend(url, training_args.vllm_server_timeout)
    if backend == BACKEND or (backend == "nccl" and gpu_available()):
        return
    if backend == "nccl":
        raise SystemExit(
            f"topr-trl: the vLLM server at {url} takes weights by NCCL, which needs a GPU here too: "
            "restart it with `topr-trl vllm-serve --model MODEL` (its gloo weight path, the default "
            "without a GPU)"
        )
    raise SystemExit(
        f"topr-trl: the vLLM server at {url} has no weight path the trainer can use "
        f"({backend or 'none'}): start it with `topr-trl vllm-serve --model MODEL`"
    )


def check_hub_push(training_args) -> None:
    """`--push_to_hub` fails before training, in one line, when it cannot succeed: the Hub out of reach or no token
    (otherwise TRL's trainer dies on a connection traceback when it creates the repository, or the push after hours of
    training fails)."""
    if not training_args.push_to_hub:
        return

    reason = hub_unreachable_reason()
    if reason is not None:
        raise SystemExit(
            f"topr-trl: --push_to_hub needs the Hugging Face Hub, which cannot be reached ({reason}); "
            "train without it and push the saved folder later with `hf upload REPO_ID OUTPUT_DIR`"
        )
    if get_token() is None:
        raise SystemExit(
            "topr-trl: --push_to_hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN "
            "(or train without --push_to_hub and push the saved folder later)"
        )


@contextlib.contextmanager
def push_failure_reported(output_dir: str, pushing: bool):
    """Around what pushes a saved run (TrainingArguments' save_model pushes too, under --push_to_hub): a failure of
    the push (the network gone since the start) says, in one line, that the model is on disk, where, and how to push
    it later; nothing trained is lost."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any failure of the push leaves the same advice
        saved = any((Path(output_dir) / name).exists() for name in ("config.json", "adapter_config.json"))
        if not pushing or not saved:
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise SystemExit(
            f"topr-trl: the model is saved in {shown_path(output_dir)}, but pushing it to the Hub failed "
            f"({type(error).__name__}: {first_line}); push it later with `hf upload REPO_ID "
            f"{shown_path(output_dir)}`"
        ) from None
