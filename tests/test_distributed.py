"""Two-process CPU data parallel and DeepSpeed ZeRO-2/3 runs of TOPRTrainer compute what one process computes on
the same global batch, and the command line trains, saves and iterates under them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import saved_model_accuracy
from .launching import (
    LAUNCH_ENVIRONMENT,
    LAUNCHES,
    SMALL_RUN,
    USER_FOLDER_DATA,
    accelerate_launch,
    as_flags,
    builtin_run_flags,
)


SCRIPT = Path(__file__).with_name("distributed_train.py")


def run_training(
    results_dir: Path, data_dir: Path, model_path: str, launch: str | None, forward: str = "padded"
) -> tuple[dict, dict]:
    """tests/distributed_train.py on the global batch of 8 rows: 1 process x 8 rows (launch None), or 2 x 4 rows
    under `accelerate launch`. Returns rank 0's logged losses and its full parameters."""
    import torch

    results_dir.mkdir()
    script = [str(SCRIPT), model_path, str(data_dir), str(results_dir / "out"), str(results_dir)]
    if launch is None:
        command = [sys.executable, *script, "8", forward]
    else:
        command = accelerate_launch(*script, "4", forward, launch=launch)
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=LAUNCH_ENVIRONMENT)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = {
        json.loads(path.read_text())["rank"]: json.loads(path.read_text()) for path in results_dir.glob("rank*.json")
    }
    world = 1 if launch is None else 2
    assert sorted(results) == list(range(world)) and all(r["world"] == world for r in results.values())
    return results[0], torch.load(results_dir / "parameters-rank0.pt")


@pytest.fixture(scope="module")
def offline_data(tiny_model_path, tmp_path_factory) -> Path:
    """32 stored completions of the tiny policy (8 prompts x 4): one pass is 4 steps of 8 rows. Stored data, not
    generation, so that one and two processes train on the same completions, rewards and mu."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.offline import generate_offline_dataset
    from topr_trl.tasks.arithmetic import make_arithmetic_dataset

    from .conftest import parity_reward

    directory = tmp_path_factory.mktemp("offline-data")
    torch.manual_seed(0)
    generate_offline_dataset(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        AutoTokenizer.from_pretrained(tiny_model_path),
        make_arithmetic_dataset(8, digits=1, seed=0),
        parity_reward,
        directory,
        num_completions=4,
        max_new_tokens=6,
        show_progress=False,
    )
    return directory


@pytest.fixture(scope="module")
def one_process_run(offline_data, tiny_model_path, tmp_path_factory) -> tuple[dict, dict]:
    return run_training(tmp_path_factory.mktemp("one") / "run", offline_data, tiny_model_path, launch=None)


@pytest.fixture(scope="module")
def top_k_data(tiny_model_path, tmp_path_factory) -> Path:
    """`offline_data` sampled at top_k 3: training scores pi on that support."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.offline import generate_offline_dataset
    from topr_trl.tasks.arithmetic import make_arithmetic_dataset

    from .conftest import parity_reward

    directory = tmp_path_factory.mktemp("top-k-data")
    torch.manual_seed(0)
    generate_offline_dataset(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        AutoTokenizer.from_pretrained(tiny_model_path),
        make_arithmetic_dataset(8, digits=1, seed=0),
        parity_reward,
        directory,
        num_completions=4,
        max_new_tokens=6,
        show_progress=False,
        top_k=3,
    )
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_under_two_processes_each_rank_scores_pi_on_mus_support(launch, top_k_data, tiny_model_path, tmp_path):
    """Data sampled at top_k 3, under DDP, ZeRO-2 and ZeRO-3 (the head gathered for the projection): every rank
    scores pi on mu's support, and two processes train what one does (as above)."""
    import torch

    (reference, reference_parameters) = run_training(tmp_path / "one", top_k_data, tiny_model_path, launch=None)
    result, parameters = run_training(tmp_path / "two", top_k_data, tiny_model_path, launch)
    second_rank = json.loads((tmp_path / "two" / "rank1.json").read_text())
    for run in (reference, result, second_rank):
        assert run["support_scored"] > 0, run
    torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    for name, value in parameters.items():
        torch.testing.assert_close(value, reference_parameters[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["ddp", "zero2"])
def test_the_shared_prompt_forward_on_two_processes_trains_what_one_padded_process_does(
    launch, one_process_run, offline_data, tiny_model_path, tmp_path
):
    """`topr_shared_prompt_forward` under DDP and ZeRO-2 (two forwards, the prompts' and the tails', before one
    backward on each rank): the per-step losses and the final parameters are those of one process with the padded
    forward, within the tolerance two processes against one already take (above)."""
    import torch

    (reference, reference_parameters) = one_process_run
    result, parameters = run_training(tmp_path / "two", offline_data, tiny_model_path, launch, forward="shared")
    second_rank = json.loads((tmp_path / "two" / "rank1.json").read_text())
    assert result["shared_prompt_forwards"] > 0 and second_rank["shared_prompt_forwards"] > 0
    assert reference["shared_prompt_forwards"] == 0
    assert result["steps"] == reference["steps"] == 4
    torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    for name, value in parameters.items():
        torch.testing.assert_close(value, reference_parameters[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_two_processes_compute_what_one_process_computes(
    launch, one_process_run, offline_data, tiny_model_path, tmp_path
):
    """The same 4 steps of 8 rows on 1 process and on 2 processes of 4 rows each: the per-step losses and the final
    parameters agree up to float summation order. A gradient averaged or normalised wrongly across processes, rows
    sharded or grouped differently, or a group statistic taken per rank would move them apart (plain SGD, so a
    gradient's scale shows in the parameters)."""
    import torch
    from transformers import AutoModelForCausalLM

    (reference, reference_parameters), (result, parameters) = (
        one_process_run,
        run_training(tmp_path / "run", offline_data, tiny_model_path, launch),
    )
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert reference["steps"] == result["steps"] == 4
    assert len(reference["losses"]) == len(result["losses"]) == 4
    loss_difference = max(abs(a - b) for a, b in zip(reference["losses"], result["losses"], strict=True))
    assert sorted(parameters) == sorted(reference_parameters)
    parameter_difference = max((parameters[n] - reference_parameters[n]).abs().max().item() for n in parameters)
    moved = max((reference_parameters[n] - initial[n]).abs().max().item() for n in reference_parameters)
    print(
        f"{launch}: 1 vs 2 processes, max |loss diff| {loss_difference:.2e}, max |parameter diff| "
        f"{parameter_difference:.2e}; parameters moved by up to {moved:.2e}"
    )
    assert moved > 1e-2  # training did something the comparison can see
    torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    for name, value in parameters.items():
        torch.testing.assert_close(value, reference_parameters[name], rtol=1e-5, atol=1e-6, msg=name)


def launch_cli(launch: str, arguments: list[str]) -> subprocess.CompletedProcess:
    # ZeRO-3 saves full weights only with zero3_save_16bit_model (set in examples/accelerate/zero3*.yaml)
    saving = ["--zero3_save_16bit_model", "true"] if launch == "zero3" else []
    command = accelerate_launch(*saving, "-m", "topr_trl", *arguments, launch=launch)
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=LAUNCH_ENVIRONMENT)


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_cli_train_under_accelerate_launch_saves_a_checkpoint_that_loads_back(launch, tmp_path):
    """`accelerate launch ... -m topr_trl train` on 2 CPU processes: the built-in model is built once (main process
    first), training runs, both the Trainer checkpoint and the final model load back with the same weights, and the
    held-out accuracies the run reports are those of its base and its saved model (warm-started, so they are not
    the 0 % of a random model)."""
    import torch
    from transformers import AutoModelForCausalLM

    output = tmp_path / "run"
    completed = launch_cli(
        launch,
        [
            "train",
            *builtin_run_flags(
                tmp_path / "base",
                warm_start_accuracy=0.1,
                max_steps=2,
                save_strategy="steps",
                save_steps=2,
                per_device_train_batch_size=4,
                num_generations=4,
                learning_rate="1e-2",
                topr_signal="reward",
                output_dir=output,
            ),
        ],
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.count("after training:") == 1  # printed by the main process only
    summary = json.loads((output / "topr_summary.json").read_text())
    base_folder = Path(summary["model"])  # the built-in model's folder, keyed under --base_model_dir
    assert base_folder.parent == tmp_path / "base"
    final = AutoModelForCausalLM.from_pretrained(output)
    checkpoint = AutoModelForCausalLM.from_pretrained(output / "checkpoint-2")
    base = AutoModelForCausalLM.from_pretrained(base_folder)
    for (name, trained), saved, _initial in zip(
        final.state_dict().items(), checkpoint.state_dict().values(), base.state_dict().values(), strict=True
    ):
        assert torch.equal(trained, saved), name
    assert any(
        not torch.equal(a, b) for a, b in zip(final.state_dict().values(), base.state_dict().values(), strict=False)
    )
    print(f"{launch}: held-out before {summary['before']}, after {summary['after']}")
    assert summary["before"] == saved_model_accuracy(base_folder, 8)
    assert summary["after"] == saved_model_accuracy(output, 8)  # evaluated on all the weights, gathered under ZeRO-3


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_cli_iterate_under_accelerate_launch(launch, tmp_path):
    """Two processes, two iterations: the main process generates each iteration's data, both train on it, and the
    first iteration's trainer (a DeepSpeed engine under ZeRO) is released before the second one starts."""
    completed = launch_cli(
        launch,
        [
            "iterate",
            "--iterations",
            "2",
            *builtin_run_flags(
                tmp_path / "base", 8, num_generations=4, per_device_train_batch_size=4, output_dir=tmp_path / "it"
            ),
        ],
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    for iteration in (0, 1):
        folder = tmp_path / "it" / f"iteration-{iteration:03d}"
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["rows"] == 32 and summary["train_steps"] == 4  # 32 rows, 2 processes x 4 rows per step
        assert len(list((folder / "data").glob("shard-*"))) == 1
    assert summary["behaviour_model"] == str(tmp_path / "it" / "iteration-000" / "model")
    assert completed.stdout.count("iteration 1: p=") == 1  # printed by the main process only


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_and_save_one_model(tmp_path):
    """`accelerate launch --num_machines 2` with machine ranks 0 and 1 (one process each, gloo, the main node at
    127.0.0.1), as docs/distributed.md runs it on real nodes: both ranks train the same steps, the main node alone
    saves the model, and it moved from the base model."""
    import socket

    import torch
    from transformers import AutoModelForCausalLM

    from .conftest import SHARED

    maker = SHARED / "tools" / "user_folder" / "make_user_folder.py"
    if not maker.is_file():
        pytest.skip(f"{maker} is absent (../shared is not beside the checkout)")
    folder = tmp_path / "user"
    subprocess.run([sys.executable, str(maker), str(folder)], check=True, capture_output=True, timeout=600)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**LAUNCH_ENVIRONMENT, "PYTHONPATH": os.pathsep.join([str(folder), LAUNCH_ENVIRONMENT["PYTHONPATH"]])}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--multi_gpu",
                "--num_machines",
                "2",
                "--machine_rank",
                str(rank),
                "--num_processes",
                "2",
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                "--mixed_precision",
                "no",
                "-m",
                "topr_trl",
                "train",
                *as_flags(
                    model_name_or_path="my-model",
                    **USER_FOLDER_DATA,
                    **SMALL_RUN,
                    topr_unscored_batch="train",
                    topr_signal="reward",
                    learning_rate="1e-2",
                    max_steps=2,
                    output_dir="two-nodes",
                ),
            ],
            cwd=folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr[-3000:]
    assert [stdout.count("model and summary saved") for stdout, _ in outputs] == [1, 0]
    assert json.loads((folder / "two-nodes" / "topr_summary.json").read_text())["steps"] == 2
    trained = AutoModelForCausalLM.from_pretrained(folder / "two-nodes")
    base = AutoModelForCausalLM.from_pretrained(folder / "my-model")
    assert any(
        not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), base.state_dict().values(), strict=True)
    )
