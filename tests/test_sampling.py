"""The one generation loop (`topr_trl.generation.completions.generate_completions`) against the model's own forward pass."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from topr_trl.generation.completions import generate_completions, stored_dtype
from topr_trl.inputs.prompts import tokenize_prompts


def test_greedy_completions_follow_the_argmax_and_stop_at_eos_kept(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = [[{"role": "user", "content": "12+3="}], [{"role": "user", "content": "7+45="}]]
    prompt_ids = tokenize_prompts(tokenizer, prompts)
    eos = tokenizer.eos_token_id
    rows = generate_completions(model, tokenizer, prompt_ids, max_new_tokens=5, do_sample=False, with_logps=True)
    # An independent greedy decode, one prompt at a time and without padding. Greedy decoding processes no logits,
    # so the reported log-probs are the model's own log-softmax at each chosen token.
    for ids, row in zip(prompt_ids, rows, strict=True):
        sequence, expected, logps = list(ids), [], []
        for _ in range(5):
            with torch.no_grad():
                logits = model(torch.tensor([sequence])).logits[0, -1].float()
            token = int(logits.argmax())
            expected.append(token)
            logps.append(float(torch.log_softmax(logits, dim=-1)[token]))
            sequence.append(token)
            if token == eos:
                break
        assert row["completion_ids"] == expected
        assert row["stopped"] == (expected[-1] == eos)
        torch.testing.assert_close(torch.tensor(row["logps"]), torch.tensor(logps))


def test_stop_token_is_kept_and_what_follows_is_dropped(tiny_model_path):
    """With every token a stop token, each completion is exactly its first token, marked stopped."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt_ids = tokenize_prompts(tokenizer, ["1+1=", "22+3="])
    rows = generate_completions(
        model, tokenizer, prompt_ids, max_new_tokens=4, do_sample=True, stop_token_ids=list(range(len(tokenizer)))
    )
    assert all(len(row["completion_ids"]) == 1 and row["stopped"] for row in rows)


def test_a_vllm_engine_is_asked_for_the_dtype_the_model_stores(tiny_model_path, tmp_path):
    """vLLM's "auto" would run a float32 model in bfloat16; the engines topr-trl builds ask for the stored dtype, and
    leave "auto" to vLLM where the config names none or no config can be read."""
    assert stored_dtype(tiny_model_path) == str(AutoModelForCausalLM.from_pretrained(tiny_model_path).dtype)[6:]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    assert stored_dtype(tmp_path / "bf16") == "bfloat16"
    assert stored_dtype(tmp_path / "missing") == "auto"
