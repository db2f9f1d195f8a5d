"""The parts of the vLLM server's weight path that need no vLLM (tests/test_vllm_server.py runs them on the real
engine): the gloo transport, the secret's middleware, `topr-trl vllm-serve`'s command and refusals, and the copy of
GRPOTrainer's `VLLMGeneration` arguments held to TRL's source."""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import subprocess
import sys
import threading

import pytest
import torch

from topr_trl.generation.vllm_server import BACKEND, SECRET_ENV


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_tensors_of_every_dtype_and_shape_cross_the_gloo_group_bit_for_bit():
    """Rank 0 broadcasts, rank 1 receives by the announced names, dtypes and shapes: bfloat16 (which gloo cannot
    reduce, but bytes are bytes), a 0-d tensor, a non-contiguous view, integers; all equal bit for bit."""
    from topr_trl.generation.vllm_server.transport import broadcast_bytes, open_group, received

    generator = torch.Generator().manual_seed(0)
    sent = {
        "embed": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "scale": torch.tensor(3.25),
        "transposed": torch.randn(4, 6, generator=generator).t(),
        "ids": torch.arange(-5, 5, dtype=torch.int64),
        "half": torch.randn(3, generator=generator).half(),
    }
    port, got, errors = free_port(), {}, []

    def receiver():
        try:
            group = open_group("127.0.0.1", port, 2, 1, 30)
            got.update(
                received(
                    group,
                    list(sent),
                    [str(t.dtype).removeprefix("torch.") for t in sent.values()],
                    [list(t.shape) for t in sent.values()],
                )
            )
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=receiver)
    thread.start()
    group = open_group("127.0.0.1", port, 2, 0, 30)
    for tensor in sent.values():
        broadcast_bytes(group, tensor)
    thread.join(timeout=60)
    assert not errors and list(got) == list(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(
            got[name].view(-1).view(torch.uint8) if tensor.dim() else got[name].reshape(1),
            tensor.contiguous().view(-1).view(torch.uint8) if tensor.dim() else tensor.reshape(1),
        )


def test_a_peer_that_never_joins_fails_the_rendezvous_after_the_timeout():
    from topr_trl.generation.vllm_server.transport import open_group

    with pytest.raises(Exception, match="(?i)timed? ?out|timeout"):
        open_group("127.0.0.1", free_port(), 2, 0, 2)


def asgi_call(middleware, path: str, headers: dict[str, str] | None = None, method: str = "POST") -> int:
    """Run one HTTP request through `middleware`; the status it answered (200: it reached the app)."""
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "client": ("10.1.2.3", 5555),
        "headers": [(key.lower().encode(), value.encode()) for key, value in (headers or {}).items()],
    }
    asyncio.run(middleware(scope, receive, send))
    return sent[0]["status"]


def test_the_secret_is_required_on_every_route_but_health_and_the_log_line_never_holds_it(monkeypatch, capsys):
    from topr_trl.generation.vllm_server.auth import WeightPathSecret

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert asgi_call(WeightPathSecret(app), "/update_weights") == 200  # no secret configured: the server is open
    monkeypatch.setenv(SECRET_ENV, "right-secret")
    guarded = WeightPathSecret(app)
    assert asgi_call(guarded, "/health", method="GET") == 200
    for path in (
        "/update_weights",
        "/init_weight_transfer_engine",
        "/collective_rpc",
        "/v1/completions",
        "/server_info",
    ):
        assert asgi_call(guarded, path) == 401
        assert asgi_call(guarded, path, {"Authorization": "Bearer wrong-secret"}) == 401
        assert asgi_call(guarded, path, {"Authorization": "Basic right-secret"}) == 401
        assert asgi_call(guarded, path, {"Authorization": "Bearer right-secret"}) == 200
    log = capsys.readouterr().err
    assert "refused POST /collective_rpc from 10.1.2.3:5555: no valid secret" in log
    assert "right-secret" not in log and "wrong-secret" not in log


def serve_arguments(**fields):
    from topr_trl.generation.vllm_server.command import VLLMServeArguments

    return VLLMServeArguments(model="my-model", **fields)


def test_vllm_serve_runs_vllms_server_module_with_the_gloo_path_on_127_0_0_1_by_default(monkeypatch):
    from topr_trl.generation.vllm_server import command

    monkeypatch.setattr(command, "cuda_available", lambda: False)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    argv, environment = command.server_command(serve_arguments(), ["--max-num-seqs", "4"])
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "my-model"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--enforce-eager" in argv
    assert argv[argv.index("--weight-transfer-config") + 1] == f'{{"backend": "{BACKEND}"}}'
    assert (
        argv[argv.index("--worker-extension-cls") + 1]
        == "topr_trl.generation.vllm_server.engine.WeightSyncWorkerExtension"
    )
    assert argv[argv.index("--middleware") + 1] == "topr_trl.generation.vllm_server.auth.WeightPathSecret"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"  # TRL's own translation, kept
    assert argv[argv.index("--max-num-seqs") + 1] == "4"  # unknown flags go to vLLM
    assert environment["VLLM_SERVER_DEV_MODE"] == "1" and SECRET_ENV not in environment
    assert command.NO_CHUNKED_PREFILL in argv  # the CPU build cannot resume a seeded split prefill
    argv, _ = command.server_command(serve_arguments(), ["--enable-chunked-prefill"])
    assert command.NO_CHUNKED_PREFILL not in argv and "--enable-chunked-prefill" in argv  # the user's choice wins

    monkeypatch.setattr(command, "cuda_available", lambda: True)
    argv, _ = command.server_command(serve_arguments(), [])
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'  # TRL's path on a GPU
    assert "--worker-extension-cls" not in argv and "--enforce-eager" not in argv
    assert command.NO_CHUNKED_PREFILL not in argv
    argv, _ = command.server_command(serve_arguments(weight_sync="gloo"), [])
    assert argv[argv.index("--weight-transfer-config") + 1] == f'{{"backend": "{BACKEND}"}}'


def test_vllm_serve_beyond_this_machine_needs_the_secret_and_takes_it_from_a_file(monkeypatch, tmp_path):
    from topr_trl.generation.vllm_server import command

    monkeypatch.setattr(command, "cuda_available", lambda: False)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=f"--host 0.0.0.0 lets other machines reach the server.*set {SECRET_ENV}"):
        command.server_command(serve_arguments(host="0.0.0.0"), [])
    (tmp_path / "secret").write_text("from-a-file\n")
    argv, environment = command.server_command(
        serve_arguments(host="0.0.0.0", secret_file=str(tmp_path / "secret")), []
    )
    assert environment[SECRET_ENV] == "from-a-file" and "from-a-file" not in " ".join(argv)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        command.server_command(serve_arguments(host="0.0.0.0", secret_file=str(tmp_path / "empty")), [])
    monkeypatch.setenv(SECRET_ENV, "from-the-environment")
    assert command.server_command(serve_arguments(host="10.0.0.5"), [])[1][SECRET_ENV] == "from-the-environment"
    with pytest.raises(ValueError, match="--weight_sync nccl needs a GPU"):
        command.server_command(serve_arguments(weight_sync="nccl"), [])


def test_vllm_serve_on_the_command_line_refuses_in_one_line():
    completed = subprocess.run(
        [sys.executable, "-m", "topr_trl", "vllm-serve", "--model", "my-model", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != SECRET_ENV},
    )
    assert completed.returncode == 1
    lines = [line for line in completed.stderr.splitlines() if line.startswith("topr-trl:")]
    assert len(lines) == 1 and "Traceback" not in completed.stderr and SECRET_ENV in lines[0], completed.stderr


def test_the_vllm_generation_arguments_are_those_grpo_trainer_passes():
    """`client.server_generation_arguments` rebuilds what GRPOTrainer's constructor gives `VLLMGeneration` (it cannot
    build server mode on a CPU): the same keywords as TRL's call, every one `VLLMGeneration` accepts."""
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer import grpo_trainer

    from topr_trl.generation.vllm_server.client import GRPO_VLLM_GENERATION_ARGUMENTS

    calls = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(grpo_trainer)))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "VLLMGeneration"
    ]
    assert len(calls) == 1
    assert tuple(keyword.arg for keyword in calls[0].keywords) == GRPO_VLLM_GENERATION_ARGUMENTS
    accepted = set(inspect.signature(VLLMGeneration.__init__).parameters) - {"self"}
    assert set(GRPO_VLLM_GENERATION_ARGUMENTS) == accepted


@pytest.mark.parametrize("noticed_by", ["http", "transport"])
def test_a_server_lost_mid_run_is_one_line_with_its_address_and_how_to_go_on(noticed_by):
    """Whichever side notices a killed server first (an HTTP request, or the gloo transport in the middle of a push,
    as CI saw once), the line names the server and says to resume on a new one; other errors pass through."""
    import requests

    from topr_trl.generation.vllm_server.client import GlooServerGeneration, ServerLost

    generation = object.__new__(GlooServerGeneration)  # only the call wrapper: no trainer, no server
    generation.vllm_client = type("Client", (), {"base_url": "http://127.0.0.1:9"})()

    def lost():
        if noticed_by == "http":
            raise requests.ConnectionError("refused")
        raise ServerLost("the weight path to the vLLM server at http://127.0.0.1:9 broke: Connection reset by peer")

    with pytest.raises(ServerLost) as raised:
        generation._server_call(lost)
    line = str(raised.value)
    assert "\n" not in line and "the vLLM server at http://127.0.0.1:9" in line
    assert line.endswith("then continue the run with --resume_from_checkpoint true"), line
    with pytest.raises(ValueError):  # not a lost server: left as it is
        generation._server_call(lambda: (_ for _ in ()).throw(ValueError("a bug")))


def test_the_rendezvous_port_gives_way_only_when_it_is_the_default():
    """A second trainer on this machine: GRPOConfig's default group port held by another process gives way to a free
    one; a port the user chose and another process holds is refused in one line naming it; a free one is kept."""
    import socket

    from topr_trl.generation.vllm_server.client import DEFAULT_GROUP_PORT, is_free_port, rendezvous_port

    with socket.socket() as other:
        other.bind(("", 0))
        other.listen()
        taken = other.getsockname()[1]
        assert not is_free_port(taken)
        with pytest.raises(ValueError, match=rf"^vllm_group_port {taken} is in use on this machine"):
            rendezvous_port(taken)
    assert rendezvous_port(taken) == taken  # released: free again
    with socket.socket() as other:
        try:
            other.bind(("", DEFAULT_GROUP_PORT))
        except OSError:
            pytest.skip(f"port {DEFAULT_GROUP_PORT} is held by something else here")
        other.listen()
        chosen = rendezvous_port(DEFAULT_GROUP_PORT)
        assert chosen != DEFAULT_GROUP_PORT and is_free_port(chosen)
    assert rendezvous_port(None) > 0


def test_against_a_gloo_server_trl_never_connects_by_nccl_and_the_users_config_is_left_as_given(
    tiny_model_path, arithmetic_dataset, tmp_path, monkeypatch
):
    """TOPRTrainer against a server running this package's gloo weight path (the server stood in: the backend it
    reports and the client it would connect): GRPOTrainer's constructor never builds its NCCL client, the trainer
    generates through the gloo client, and it holds the user's own config object, still saying use_vllm=True, at
    every moment the user could look (the config is not flipped and restored around TRL's constructor)."""
    import trl.trainer.grpo_trainer as grpo_trainer

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.generation.vllm_server import client as gloo_client

    from .conftest import parity_reward, small_config_kwargs

    args = TOPRConfig(
        **small_config_kwargs(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:1")
    )
    seen = []

    class NoNCCL:
        def __init__(self, **kwargs):
            raise AssertionError("GRPOTrainer built its NCCL server client")

    class StandInGlooClient:
        def __init__(self, **kwargs):
            seen.append(("client", args.use_vllm))

    # the trainer imports the gloo client where server mode needs it, from its module
    monkeypatch.setattr(gloo_client, "uses_gloo_server", lambda config: True)
    monkeypatch.setattr(gloo_client, "GlooServerGeneration", StandInGlooClient)
    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", NoNCCL)
    original_init = grpo_trainer.GRPOTrainer.__init__

    def watched_init(self, *init_args, **init_kwargs):
        seen.append(("TRL's constructor", args.use_vllm))
        original_init(self, *init_args, **init_kwargs)

    monkeypatch.setattr(grpo_trainer.GRPOTrainer, "__init__", watched_init)
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    assert trainer.args is args and args.use_vllm is True
    assert trainer.use_vllm is True and isinstance(trainer.vllm_generation, StandInGlooClient)
    assert seen == [("TRL's constructor", True), ("client", True)]
