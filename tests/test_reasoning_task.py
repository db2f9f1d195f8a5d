"""The reasoning testbed: written solutions, their classes and rewards, the planted error's rate, disjoint splits,
and the warm-started model's cache key."""

import dataclasses
import hashlib
import itertools
import json
import random
import re
from pathlib import Path

import pytest

from topr_trl.commands.arguments import TaskArguments
from topr_trl.evaluation.rewards import CORRECT, INCORRECT, INVALID
from topr_trl.evaluation.runner import evaluate_model
from topr_trl.tasks import reasoning
from topr_trl.tasks.reasoning import (
    PLANTED,
    SETTINGS_FILE,
    SPLITS,
    WarmStartSettings,
    build_reasoning_warm_model,
    diagnose,
    make_problems,
    make_reasoning_dataset,
    make_warm_start_dataset,
    max_completion_tokens,
    measure_base_model,
    parse_problem,
    parse_solution,
    planted_error_solution,
    reasoning_classify,
    reasoning_reward,
    split_of,
    split_size,
    warm_model_path,
    write_solution,
)


def _as_message(text):
    return [{"role": "assistant", "content": text}]


def test_written_solution_reads_digit_by_digit_with_carries():
    assert write_solution(4587, 2896) == "7+6+0=13|8+9+1=18|5+8+1=14|4+2+1=07|=7483"
    assert write_solution(4587, 2896, dropped=[1]) == "7+6+0=13|8+9+0=17|5+8+1=14|4+2+1=07|=7473"
    assert write_solution(999, 1) == "9+1+0=10|9+0+1=10|9+0+1=10|=1000"
    assert write_solution(999, 1, dropped=[3]) == "9+1+0=10|9+0+1=10|9+0+1=10|=0"
    assert write_solution(999, 1, dropped=[1]) == "9+1+0=10|9+0+0=09|9+0+0=09|=990"  # later carries never arrive


def test_round_trip_correct_dropped_carry_and_broken_format():
    rng = random.Random(0)
    for _ in range(300):
        a, b = rng.randint(100, 9999), rng.randint(100, 9999)
        text = write_solution(a, b)
        # the written answer agrees with Python's addition, and the steps number one per digit
        assert parse_solution(text).answer == str(a + b)
        assert len(parse_solution(text).steps) == len(str(max(a, b)))
        assert reasoning_classify(text, str(a + b)) == CORRECT
        assert diagnose(text, a, b)["kind"] == "correct"
        # one dropped carry makes the answer short by exactly that power of ten
        for position in range(1, len(str(max(a, b))) + 1):
            wrong = write_solution(a, b, dropped=[position])
            if wrong == text:  # no carry arrives there
                continue
            assert int(parse_solution(wrong).answer) == a + b - 10**position
            assert reasoning_classify(wrong, str(a + b)) == INCORRECT
            assert diagnose(wrong, a, b) == {"class": INCORRECT, "errors": {"dropped_carry"}, "kind": PLANTED}

    right, dropped = write_solution(4587, 2896), write_solution(4587, 2896, dropped=[2])
    broken = [
        right[:-1] + "x",
        right.split("|=")[0],
        right + " 7",
        "7483",
        "",
        right.replace("+1=", "+2="),
        right.replace("=13", "=3"),
        "=7483",
    ]
    completions = [right, _as_message(right), dropped, *broken]
    assert reasoning_reward(completions, ["7483"] * len(completions)) == [1.0, 1.0] + [-1.0] * (1 + len(broken))
    assert [reasoning_classify(text, "7483") for text in broken] == [INVALID] * len(broken)
    assert [diagnose(text, 4587, 2896)["kind"] for text in broken] == [INVALID] * len(broken)


def test_diagnose_tells_other_errors_from_the_planted_one():
    right = write_solution(4587, 2896)
    copy_slip = right.replace("8+9+1=18", "8+8+1=17").replace("=7483", "=7473")
    sum_slip = right.replace("5+8+1=14", "5+8+1=15").replace("=7483", "=7583")
    answer_slip = right.replace("=7483", "=7484")
    assert diagnose(copy_slip, 4587, 2896)["errors"] == {"copy"}
    assert diagnose(sum_slip, 4587, 2896)["errors"] == {"arithmetic"}
    assert diagnose(answer_slip, 4587, 2896)["errors"] == {"answer"}
    assert {diagnose(text, 4587, 2896)["kind"] for text in (copy_slip, sum_slip, answer_slip)} == {"other"}


@pytest.mark.parametrize("error_rate", [0.1, 0.5])
def test_planted_error_rate_at_one_position(error_rate):
    """Position 1 receives a carry exactly when the units digits sum to 10 or more, whatever else happens."""
    data = make_warm_start_dataset(3000, digits=3, error_rate=error_rate, error_positions=(1,), seed=1)
    carried = [
        (int(p[0]["content"].split("+")[0]) % 10 + int(p[0]["content"].split("+")[1][:-1]) % 10) >= 10
        for p in data["prompt"]
    ]
    dropped = [bool(d) for d in data["dropped"]]
    assert all(d == [1] for d in data["dropped"] if d)
    assert not any(d and not c for d, c in zip(dropped, carried, strict=False))
    rate = sum(dropped) / sum(carried)
    assert abs(rate - error_rate) < 0.05, rate
    for text, answer, positions, prompt in zip(
        data["solution"], data["answer"], data["dropped"], data["prompt"], strict=False
    ):
        assert (parse_solution(text).answer == answer) == (not positions)
        assert diagnose(text, *parse_problem(prompt))["kind"] == (PLANTED if positions else "correct")


def test_planted_error_rate_over_all_positions():
    """Every carry that arrives is dropped with the same probability: count the kept carries in the text."""
    error_rate = 0.3
    data = make_warm_start_dataset(3000, digits=3, error_rate=error_rate, seed=2)
    kept = dropped = 0
    for text, positions in zip(data["solution"], data["dropped"], strict=True):
        kept += text.count("+1=") + (len(parse_solution(text).answer) > 3)
        dropped += len(positions)
    rate = dropped / (kept + dropped)
    assert abs(rate - error_rate) < 0.03, rate
    assert make_warm_start_dataset(200, 3, error_rate=0.0)["dropped"] == [[]] * 200
    with pytest.raises(ValueError, match="error_rate"):
        planted_error_solution(123, 456, 1.5, random.Random(0))


def test_splits_are_disjoint_whatever_the_seeds():
    held_out = make_reasoning_dataset(1000, digits=3, split="heldout", seed=0)
    train = make_reasoning_dataset(2000, digits=3, split="train", seed=0)
    warm = make_warm_start_dataset(2000, digits=3, seed=0)
    validation = make_reasoning_dataset(1000, digits=3, split="validation", seed=0)
    unordered = [{frozenset(parse_problem(p)) for p in d["prompt"]} for d in (held_out, train, warm, validation)]
    assert len({parse_problem(p) for p in held_out["prompt"]}) == 1000
    assert len({parse_problem(p) for p in validation["prompt"]}) == 1000
    for i, j in itertools.combinations(range(4), 2):
        assert not unordered[i] & unordered[j], (i, j)
    # another seed gives other problems, never from another split
    other = {frozenset(parse_problem(p)) for p in make_reasoning_dataset(1000, 3, "train", seed=7)["prompt"]}
    assert other != unordered[1] and not other & unordered[0] and not other & unordered[2]
    assert held_out["prompt"] == make_reasoning_dataset(1000, 3, "heldout", seed=0)["prompt"]  # deterministic
    # a+b and b+a always share a split; every problem has exactly one
    rng = random.Random(0)
    for _ in range(2000):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        assert split_of(a, b) == split_of(b, a) in SPLITS
    # answers are the sums, operands have exactly `digits` digits
    for prompt, answer in zip(held_out["prompt"], held_out["answer"], strict=False):
        a, b = parse_problem(prompt)
        assert 100 <= a <= 999 and 100 <= b <= 999 and answer == str(a + b)


def test_split_sizes_and_errors():
    counts = {name: split_size(2, name) for name in SPLITS}
    assert sum(counts.values()) == 90 * 90
    assert split_size(3, "heldout") >= 1000
    assert len(make_problems(counts["heldout"], 2, "heldout")) == counts["heldout"]
    with pytest.raises(ValueError, match="only"):
        make_problems(counts["heldout"] + 1, 2, "heldout")
    with pytest.raises(ValueError, match="split must be"):
        make_problems(10, 3, "test")
    with pytest.raises(ValueError, match="not a reasoning-task prompt"):
        parse_problem("2*3=")


def test_cache_path_changes_with_every_setting():
    base = WarmStartSettings()
    changed = dict(
        digits=4,
        error_rate=0.5,
        error_positions=(1,),
        num_examples=1000,
        steps=10,
        batch_size=8,
        learning_rate=1e-3,
        hidden_size=32,
        num_layers=3,
        seed=1,
        device="cuda",
        spurious_carry_rate=0.1,
    )
    assert set(changed) == {f.name for f in dataclasses.fields(WarmStartSettings)}
    paths = {warm_model_path("cache", base)}
    for name, value in changed.items():
        paths.add(warm_model_path("cache", dataclasses.replace(base, **{name: value})))
    assert len(paths) == len(changed) + 1
    assert warm_model_path("cache", base) == warm_model_path("cache", WarmStartSettings())
    # the format version is part of the key
    assert base.to_dict()["format_version"] == reasoning.FORMAT_VERSION
    # positions are normalised, so the same setting gives the same path
    assert warm_model_path("c", WarmStartSettings(error_positions=[2, 1, 2])) == warm_model_path(
        "c", WarmStartSettings(error_positions=(1, 2))
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(digits=1), "digits"),
        (dict(error_rate=-0.1), "error_rate"),
        (dict(error_positions=(0,)), "error_positions"),
        (dict(error_positions=(4,)), "error_positions"),
        (dict(steps=0), "steps"),
        (dict(learning_rate=0.0), "learning"),
    ],
)
def test_settings_are_validated(bad, message):
    with pytest.raises(ValueError, match=message):
        WarmStartSettings(**bad)


TINY = dict(digits=2, num_examples=64, steps=2, batch_size=4, hidden_size=16, num_layers=1)


def test_builder_caches_and_refuses_a_model_built_with_other_settings(tmp_path, monkeypatch):
    model, tokenizer, path = build_reasoning_warm_model(tmp_path, **TINY)
    assert path == warm_model_path(tmp_path, WarmStartSettings(**TINY)) and (path / "config.json").exists()
    assert json.loads((path / SETTINGS_FILE).read_text()) == WarmStartSettings(**TINY).to_dict()
    assert model.config.hidden_size == 16 and model.config.num_hidden_layers == 1

    def no_training(*args, **kwargs):
        raise AssertionError("a cached model was trained again")

    monkeypatch.setattr("topr_trl.tasks.arithmetic.warm_start", no_training)
    build_reasoning_warm_model(tmp_path, WarmStartSettings(**TINY))
    # the recorded settings are checked: a directory whose record disagrees is refused
    (path / SETTINGS_FILE).write_text(json.dumps(WarmStartSettings(**{**TINY, "seed": 5}).to_dict()))
    with pytest.raises(ValueError, match="other settings"):
        build_reasoning_warm_model(tmp_path, **TINY)


def test_evaluate_model_and_measure_score_the_task(tmp_path):
    """The project's evaluation scores the task; a 2-step warm start writes no valid solution yet."""
    model, tokenizer, _ = build_reasoning_warm_model(tmp_path, **TINY)
    held_out = make_reasoning_dataset(6, digits=2, split="heldout")
    result = evaluate_model(
        model, tokenizer, held_out, reasoning_classify, k=2, max_new_tokens=8, show_progress=False, num_bootstrap=5
    )
    assert result.num_prompts == 6 and result.invalid_rate == 1.0 and result.pass_at_1 == 0.0
    report = measure_base_model(model, tokenizer, held_out, num_samples=2)
    assert report["pass@1"] == 0.0 and report["invalid_rate"] == 1.0 and report["greedy_accuracy"] == 0.0
    assert 1 <= report["mean_completion_tokens"] <= max_completion_tokens(2)


def test_max_completion_tokens_fits_the_longest_solution():
    from topr_trl.tasks.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    for digits in (2, 3, 5):
        longest = write_solution(10**digits - 1, 10**digits - 1)
        assert re.fullmatch(r"[0-9+=|]+", longest)
        assert len(tokenizer(longest, add_special_tokens=False)["input_ids"]) + 1 <= max_completion_tokens(digits)


@pytest.mark.slow
@pytest.mark.heavy  # minutes: not in CI (setup.cfg)
def test_warm_start_plants_the_error_at_the_paper_regime(tmp_path, monkeypatch):
    """The recommended setting (3 digits, a quarter of carries dropped, 2,000 steps: ~2-4 CPU minutes), trained here
    rather than installed from the shipped weights, lands near two thirds sampled pass@1, and most wrong answers
    show the planted error."""
    monkeypatch.setattr("topr_trl.tasks.tiny.PREBUILT_DIR", tmp_path / "nothing-shipped")
    model, tokenizer, path = build_reasoning_warm_model(tmp_path, WarmStartSettings())
    assert (path / "build.json").is_file()  # trained here, and says on what
    report = measure_base_model(model, tokenizer, make_reasoning_dataset(300, 3, "heldout"), num_samples=4)
    assert 0.55 <= report["pass@1"] <= 0.8 and report["planted_share"] > 0.7 and report["invalid_rate"] < 0.05


def test_count_carries_counts_every_carry_including_the_one_out_of_the_top_step():
    from topr_trl.tasks.reasoning import count_carries, write_solution

    assert count_carries(123, 456) == 0
    assert count_carries(4587, 2896) == 3  # into the tens, hundreds and thousands; 4+2+1 = 7 carries nothing out
    assert count_carries(999, 1) == 3  # into the tens and hundreds, and out of the top step (the answer's 1)
    assert count_carries(500, 500) == 1  # out of the top step only
    for a, b in [(4587, 2896), (123, 456), (999, 1), (500, 500), (358, 647)]:
        solution = write_solution(a, b)
        assert count_carries(a, b) == solution.count("+1=") + (len(str(a + b)) > len(str(max(a, b))))


def test_default_built_in_models_are_the_shipped_weights_on_every_machine(tmp_path):
    """The default settings install the shipped weights byte for byte (whatever the threads or CPU kernels here),
    under a folder named by the settings alone; the shipped reasoning model is in the paper's regime."""
    from topr_trl.tasks.loading import builtin_model
    from topr_trl.tasks.tiny import PREBUILT_DIR, machine_key

    for task, options in (
        ("reasoning", TaskArguments(task_digits=3, base_model_dir=str(tmp_path / "r"))),
        ("arithmetic", TaskArguments(base_model_dir=str(tmp_path / "a"))),
    ):
        folder = Path(builtin_model(task, options, seed=0))
        shipped = PREBUILT_DIR / folder.name
        assert machine_key() not in folder.name
        assert (folder / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
    model, tokenizer, _ = build_reasoning_warm_model(tmp_path / "r", WarmStartSettings())
    measured = measure_base_model(model, tokenizer, make_reasoning_dataset(200, 3, "heldout", seed=0))
    assert 0.5 < measured["pass@1"] < 0.85  # about two thirds of samples correct, as in the paper


def test_the_second_planted_error_writes_a_carry_where_none_arrives():
    spurious_rate = 0.3
    data = make_warm_start_dataset(2000, digits=3, error_rate=0.0, seed=3, spurious_carry_rate=spurious_rate)
    arrivals = added_total = 0
    for text, prompt, added, dropped in zip(
        data["solution"], data["prompt"], data["added"], data["dropped"], strict=True
    ):
        a, b = parse_problem(prompt)
        assert dropped == [] and text == write_solution(a, b, added=added)
        # each added carry makes the answer too large by that power of ten (the steps after follow from it)
        assert int(parse_solution(text).answer) == a + b + sum(10**position for position in added)
        if added:
            assert diagnose(text, a, b)["kind"] == "other"  # not the planted carry drop
            assert "wrong_carry" in diagnose(text, a, b)["errors"]
        # the positions where no carry arrives in the solution as written (steps 1 and 2 of 3)
        written = parse_solution(text).steps
        arrivals += sum(1 for i in (1, 2) if written[i][2] == 0 or i in added)
        added_total += len(added)
    assert abs(added_total / arrivals - spurious_rate) < 0.03
    # off by default, and then the settings and the key are those of every model built before it existed
    assert "spurious_carry_rate" not in WarmStartSettings().to_dict()
    # ... and so are the warm-start solutions: this digest was computed with the code before the second error existed
    # (commit bd0676f), so a change in how the generator is drawn at rate 0 fails here
    unchanged = make_warm_start_dataset(500, 3, error_rate=0.25, seed=0)["solution"]
    assert hashlib.sha256("\n".join(unchanged).encode()).hexdigest()[:16] == "7ae32d6ff2e17fd9"
    harder = WarmStartSettings(digits=5, spurious_carry_rate=0.1)
    assert harder.to_dict()["spurious_carry_rate"] == 0.1 and "-s0.1-" in harder.key()
    with pytest.raises(ValueError, match="spurious_carry_rate must be in"):
        WarmStartSettings(spurious_carry_rate=1.5)


def test_two_processes_installing_one_shipped_model_at_once_both_get_it_whole(tmp_path):
    """Two runs sharing a cache folder (one per core) install the same shipped model at the same time: each copies
    into a folder of its own, the first rename publishes it, the other copy is dropped; neither fails and no half
    model or staging folder is left behind. (Both once copied into one shared `.partial` folder, and the slower
    one failed with `shutil.Error` when the faster renamed it away.)"""
    import multiprocessing

    from topr_trl.tasks.tiny import PREBUILT_DIR

    key = WarmStartSettings().key()
    destination = tmp_path / "cache" / key
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        installed = pool.starmap(_install, [(key, str(destination))] * 8)
    assert installed == [True] * 8
    shipped = PREBUILT_DIR / key
    assert sorted(p.name for p in destination.iterdir()) == sorted(p.name for p in shipped.iterdir())
    assert (destination / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
    assert [p.name for p in destination.parent.iterdir()] == [key]  # no staging folder left


def _install(key: str, destination: str) -> bool:
    from topr_trl.tasks.tiny import install_prebuilt

    return install_prebuilt(key, destination)


def test_a_staged_folder_is_published_whole_or_not_at_all(tmp_path):
    from topr_trl.tasks.tiny import staged_folder

    destination = tmp_path / "model"
    with pytest.raises(RuntimeError, match="interrupted"), staged_folder(destination) as staging:
        (staging / "config.json").write_text("{}")
        raise RuntimeError("interrupted")  # a build that fails half way publishes nothing
    assert list(tmp_path.iterdir()) == []
    with staged_folder(destination) as staging:
        (staging / "config.json").write_text('{"first": true}')
        with staged_folder(destination) as other:  # another process finishes first
            (other / "config.json").write_text('{"second": true}')
        assert (destination / "config.json").read_text() == '{"second": true}'
    assert (destination / "config.json").read_text() == '{"second": true}'  # the finished copy stays
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    (destination / "config.json").unlink()  # a folder there that is no model: refused, not silently kept
    (destination / "stray").write_text("")
    with pytest.raises(OSError), staged_folder(destination) as staging:
        (staging / "config.json").write_text("{}")
