"""The benchmark script runs end to end (times are not asserted: they belong to the benchmark's report)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


SCRIPT = Path(__file__).resolve().parents[1] / "benchmark.py"


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    output = tmp_path / "bench.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--settings",
            "grpo-grpo",
            "topr-online",
            "topr-offline",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads(output.read_text())
    assert set(summary["table"]) == {"grpo-grpo", "topr-online", "topr-offline"}
    assert summary["ratios"]["topr-online / grpo-grpo"]["step_time"] > 0


@pytest.mark.slow
def test_benchmark_interleaved_smoke_with_offline_replay(tmp_path):
    output = tmp_path / "bench.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--interleaved",
            "--settings",
            "grpo-grpo",
            "topr-online",
            "topr-replay",
            "topr-replay-recompute",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(output.read_text())["interleaved"]
    assert set(result["ratios"]) == {"topr-online / grpo-grpo", "topr-replay-recompute / topr-replay"}
    assert all(row["median_cpu_s"] > 0 for row in result["table"].values())


@pytest.mark.slow
def test_benchmark_loss_only_smoke_times_the_support_on_an_off_policy_batch(tmp_path):
    """Loss + backward of every trainer on one batch carrying mu's log-probs (as off-policy data does), top-k on the
    on-policy batch apart, where TOPR has no support to score, and top-k with the support projected a second time
    (the baseline of reading it from TRL's head tiles)."""
    output = tmp_path / "bench.json"
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--loss_only", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(output.read_text())["loss_only"]
    assert set(result["median_loss_backward_s"]) == {
        "grpo-grpo",
        "grpo-dapo",
        "topr-online",
        "topr-online-top-k",
        "topr-online-top-p",
        "topr-online-top-k, on-policy batch",
        "topr-online-top-k, every sequence scored",
    }
    assert all(value > 0 for value in result["ratios"].values())
    if benchmark_memory_is_measured():  # a smoke call may add nothing measurable (under the 1 MiB mmap threshold)
        assert set(result["peak_added_memory_mib"]) == set(result["median_loss_backward_s"])
        assert all(value >= 0 for value in result["peak_added_memory_mib"].values())
        peaks = result["peak_added_memory_mib"]
        # every ratio is the two peaks' quotient, or None where either call added nothing measurable (a smoke call
        # can add nothing at all: then a ratio of 0 or inf would say nothing)
        for key, ratio in result["peak_added_memory_ratios"].items():
            name, base = key.split(" / ")
            if peaks[name] > 0 and peaks[base] > 0:
                assert ratio == pytest.approx(peaks[name] / peaks[base], rel=1e-9)
            else:
                assert ratio is None


def benchmark_memory_is_measured() -> bool:
    return Path("/proc/self/clear_refs").exists() and sys.platform == "linux"


MEMORY_PROBE = """
import sys, torch
from experiments import benchmark
watch = benchmark.AddedMemory(torch, cuda=False)
if not watch.available:
    sys.exit(3)
first = torch.ones(2**22)  # 16 MiB: glibc's own threshold would rise past 8 MiB when it is freed
del first
freed = [torch.ones(2**21) for _ in range(8)]  # 8 x 8 MiB
del freed[:7]  # 56 MiB freed under the last one: glibc would keep them for the next allocations
watch.start()
held = [torch.ones(2**21) for _ in range(4)]
del held
print(watch.peak_mib())
watch.start()
print(watch.peak_mib())
"""


def test_the_memory_a_call_adds_is_what_it_holds_at_its_peak_on_a_cpu():
    """`AddedMemory` on a Linux CPU (in its own process, as it fixes glibc's mmap threshold for the process): a call
    that holds four 8 MiB tensors adds 32 MiB at its peak, within 3 MiB (the interpreter's own pages come and go),
    although 56 MiB freed just before would have served them with glibc's own threshold (16 MiB measured then); a
    call that allocates nothing adds under 3 MiB."""
    completed = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=300, cwd=SCRIPT.parents[1]
    )
    if completed.returncode == 3:
        pytest.skip("no /proc/self/clear_refs or glibc mallopt here")
    assert completed.returncode == 0, completed.stderr[-3000:]
    peak, nothing = (float(line) for line in completed.stdout.split())
    assert abs(peak - 32) < 3
    assert nothing < 3


# A 1-layer model counted by hand: d=8, 2 heads of 4, 1 KV head, MLP 16, vocabulary 10.
ONE_LAYER = dict(
    hidden_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=16,
    vocab_size=10,
)


def test_model_flops_follow_the_palm_convention():
    """Hand count for a 1-layer model: d=8, 2 heads of 4, 1 KV head, MLP 16, vocabulary 10, sequence 5."""
    from types import SimpleNamespace

    from experiments import benchmark

    config = SimpleNamespace(**ONE_LAYER)
    attention = 8 * 4 * (2 + 2) + 2 * 4 * 8  # q, k, v projections + output projection
    parameters = attention + 3 * 8 * 16 + 8 * 10  # + gated MLP + LM head
    flops = benchmark.model_flops_per_token(config, sequence_length=5)
    assert flops["parameters"] == parameters == 656
    assert flops["forward"] == 2 * 656 + 4 * 1 * 8 * 5
    assert flops["forward_backward"] == 3 * flops["forward"]
    options = {"prompt_length": 3, "completion_length": 2, "batch_size": 4}
    online = benchmark.step_flops(config, options, "topr-online")
    with_reference = benchmark.step_flops(config, options, "grpo-grpo-kl")
    replay = benchmark.step_flops(config, options, "topr-replay")
    assert online["generation"] == flops["forward"] * 4 * 5 and replay["generation"] == 0
    assert with_reference["update"] - online["update"] == flops["forward"] * 4 * 5


def test_the_shared_prompt_flops_bound_counts_each_distinct_prompt_once():
    """Hand count on the 1-layer model above: 4 rows of 3 prompt and 2 completion tokens, 2 distinct prompts, 7
    completion tokens scored. Per token the backbone costs 2 x 576 (656 parameters less the 80 of the head) plus
    4 x 1 x 8 per key; the head 2 x 80 per scored token, alike in both."""
    from types import SimpleNamespace

    import torch

    from experiments import benchmark

    config = SimpleNamespace(**ONE_LAYER)
    prompts = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 8, 9], [0, 8, 9]])
    batch = {
        "prompt_ids": prompts,
        "prompt_mask": (prompts > 0).long(),
        "completion_ids": torch.ones(4, 2, dtype=torch.long),
        "completion_mask": torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]]),
    }
    padded = 20 * (1152 + 32 * 5) + 160 * 7  # every row whole: 4 x 5 tokens against 5 keys
    shared = 2 * 2 * (1152 + 32 * 3) + 4 * 3 * (1152 + 32 * 5) + 160 * 7  # 2 prompts but their last token; 4 tails
    assert benchmark.shared_prompt_flops_bound(config, batch) == pytest.approx(shared / padded, rel=1e-12)


@pytest.mark.parametrize("shape,published_parameters", [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304)])
def test_qwen_shaped_models_have_the_published_parameter_counts(shape, published_parameters):
    """The GPU benchmark's models are Qwen2.5 as published, LM head and 151,936-token vocabulary included (built on
    the meta device: shapes only)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from experiments import benchmark
    from topr_trl.tasks.tiny import build_tokenizer

    with torch.device("meta"):
        model = Qwen2ForCausalLM(benchmark.qwen_config(shape, build_tokenizer()))
    assert sum(parameter.numel() for parameter in model.parameters()) == published_parameters


GPU_SCRIPT = SCRIPT.parent / "gpu_support.sh"


def test_the_gpu_script_answers_a_wrong_call_with_its_usage_in_one_line(tmp_path):
    for arguments in ([], ["measure"], ["run", str(tmp_path), "--fast"]):
        completed = subprocess.run(["bash", str(GPU_SCRIPT), *arguments], capture_output=True, text=True, timeout=60)
        assert completed.returncode == 2 and len(completed.stderr.strip().splitlines()) == 1, completed.stderr
        assert "usage:" in completed.stderr


@pytest.mark.slow
def test_the_gpu_script_runs_every_step_and_leaves_what_a_lease_brings_back(tmp_path):
    """`experiments/gpu_support.sh run OUT --smoke --device cpu`: every step passes, OUT holds the seven files a lease
    brings back (no more), the rule's timings cover both shapes and both truncations, and each loss file's ratios are
    its medians' quotients."""
    out = tmp_path / "out"
    completed = subprocess.run(
        ["bash", str(GPU_SCRIPT), "run", str(out), "--smoke", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert completed.returncode == 0, completed.stdout[-3000:]
    assert "every step passed" in completed.stdout
    names = {path.name for path in out.iterdir()}
    assert names == {
        "versions.txt",
        "log.txt",
        "support-rule.json",
        "support-loss-scale1.json",
        "support-loss-scale4.json",
        "support-loss-scale8.json",
        "shared-prompt.json",
    }
    rule = json.loads((out / "support-rule.json").read_text())["support_only"]["timings"]
    assert set(rule) == {"flat top_k 50", "flat top_p 0.95", "peaked top_k 50", "peaked top_p 0.95"}
    assert all(value > 0 for row in rule.values() for value in row["ms_per_1k_tokens"].values())
    for scale in (1, 4, 8):
        loss = json.loads((out / f"support-loss-scale{scale}.json").read_text())["loss_only"]
        medians = loss["median_loss_backward_s"]
        assert loss["ratios"]["topr-online-top-p / topr-online"] == pytest.approx(
            medians["topr-online-top-p"] / medians["topr-online"], rel=1e-12
        )
    shared = json.loads((out / "shared-prompt.json").read_text())
    for generations, row in shared["shared_prompt"]["per_prompt"].items():
        medians = row["median_loss_backward_s"]
        assert row["loss_backward_vs_grpo"] == pytest.approx(medians["topr-shared-prompt"] / medians["grpo-dapo"])
        assert 0 < row["flops_bound"] < 1, generations
        memory = row["peak_added_memory_mib"]  # one process per trainer: a number each, or None where unmeasurable
        assert set(memory) == {"grpo-dapo", "topr-shared-prompt", "topr-padded"}, generations
        assert all(value is None or value >= 0 for value in memory.values()), memory
    assert shared["loss_backward_vs_grpo"] == shared["shared_prompt"]["per_prompt"]["8"]["loss_backward_vs_grpo"]
