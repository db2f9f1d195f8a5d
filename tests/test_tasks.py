"""The built-in task's greedy accuracy, invalid rate and malformed rate, on scripted model outputs."""

from types import SimpleNamespace

import torch
from datasets import Dataset

from topr_trl.tasks.arithmetic import accuracy


class ScriptedModel:
    """Stands in for a causal LM whose greedy answers are fixed strings (EOS appended where `stops`)."""

    training = False
    device = torch.device("cpu")

    def __init__(self, tokenizer, answers: list[str], stops: list[bool]):
        self.tokenizer, self.answers, self.stops = tokenizer, answers, stops

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        rows = []
        for answer, stop in zip(self.answers, self.stops, strict=True):
            ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
            ids += [self.tokenizer.eos_token_id] if stop else []
            rows.append(ids + [self.tokenizer.pad_token_id] * (max_new_tokens - len(ids)))
        return SimpleNamespace(sequences=torch.cat([input_ids, torch.tensor(rows)], dim=1))  # return_dict_in_generate


def test_accuracy_counts_invalid_and_malformed_answers(tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1="}]] * 5, "answer": ["2"] * 5})
    answers = ["2", "2", "2 3", "x", "3"]  # right; right but never stopped; right first integer with junk
    stops = [True, False, True, True, True]  # after it; no integer at all; wrong but well formed
    result = accuracy(ScriptedModel(tokenizer, answers, stops), tokenizer, dataset, max_new_tokens=6)
    assert result == {"accuracy": 3 / 5, "invalid_rate": 1 / 5, "malformed_rate": 3 / 5}
