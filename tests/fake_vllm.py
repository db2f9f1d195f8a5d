"""A stand-in for the parts of vLLM's offline API that topr_trl uses, so that their contract is tested in the default
run (the real engine, vLLM's CPU build, is tested in tests/test_vllm.py with `bash scripts/test.sh --vllm`).

It mirrors vLLM's contract, not our code: `LLM(model=..., seed=..., logprobs_mode=...)`, `SamplingParams` with
vLLM's names (`n`, `max_tokens`, `top_k=-1` for no truncation, `logprobs=0`), prompts given as
`{"prompt_token_ids": [...]}`, and `generate` returning request outputs whose samples carry `token_ids` (EOS included
when the sample stopped on it), `finish_reason` ("stop" or "length") and `logprobs`: one `{token_id: Logprob}` per
position. Sampling is its own token-by-token loop over a transformers model, independent of topr_trl.offline.rollout.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    logprobs: int | None = None
    skip_special_tokens: bool = True
    seed: int | None = None
    stop: list[str] | None = None


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str
    text: str = ""


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]


class LLM:
    instances: list[LLM] = []

    def __init__(self, model: str, seed: int = 0, logprobs_mode: str = "raw_logprobs", **kwargs):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.logprobs_mode = logprobs_mode
        self.generator = torch.Generator().manual_seed(seed)
        self.requests: list[list[int]] = []
        LLM.instances.append(self)

    def _processed_logprobs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        logits = logits / params.temperature
        if params.top_k > 0:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(ordered, -1).cumsum(-1)
            drop = cumulative - torch.softmax(ordered, -1) >= params.top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return torch.log_softmax(logits, -1)

    @torch.no_grad()
    def generate(self, prompts: list[dict], sampling_params: SamplingParams, use_tqdm: bool = True):
        results = []
        for prompt in prompts:
            self.requests.append(list(prompt["prompt_token_ids"]))
            samples = []
            for _ in range(sampling_params.n):
                ids, logprobs, finish = list(prompt["prompt_token_ids"]), [], "length"
                for _ in range(sampling_params.max_tokens):
                    logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                    step = self._processed_logprobs(logits, sampling_params)
                    token = int(torch.multinomial(step.exp(), 1, generator=self.generator))
                    ids.append(token)
                    logprobs.append({token: Logprob(float(step[token]))})
                    if token == self.eos_token_id:
                        finish = "stop"
                        break
                    text = self.tokenizer.decode(ids[len(prompt["prompt_token_ids"]) :], skip_special_tokens=True)
                    if any(stop in text for stop in sampling_params.stop or ()):
                        finish = "stop"  # vLLM stops on a stop string and leaves it out of `text`
                        break
                new = ids[len(prompt["prompt_token_ids"]) :]
                text = self.tokenizer.decode(new, skip_special_tokens=sampling_params.skip_special_tokens)
                for stop in sampling_params.stop or ():
                    text = text.split(stop)[0]
                samples.append(CompletionOutput(new, logprobs, finish, text))
            results.append(RequestOutput(samples))
        return results


cleanups: list[str] = []


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's release of engine memory; like the real one it would tear down torch.distributed's process group."""
    cleanups.append("cleanup_dist_env_and_memory")


def install(monkeypatch) -> types.ModuleType:
    """Make `import vllm` (and `vllm.distributed.parallel_state`) return this stand-in for the duration of a test."""
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM, module.SamplingParams = LLM, SamplingParams
    distributed = types.ModuleType("vllm.distributed")
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.cleanup_dist_env_and_memory = cleanup_dist_env_and_memory
    module.distributed, distributed.parallel_state = distributed, parallel_state
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.distributed", distributed)
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", parallel_state)
    LLM.instances.clear()
    cleanups.clear()
    return module
