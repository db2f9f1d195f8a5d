"""Run by test_async_distributed.py under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo): builds
AsyncTOPRTrainer against a server that says it runs this package's gloo weight path (a stub answering `/server_info`
on the main process, as `topr-trl vllm-serve` would), with a PEFT model, as several training processes against one
server do, and writes per rank what each process's constructor decided. TRL's rollout worker needs vLLM to be built,
so a stand-in takes its place in TRL's module for this process: what is under test is the constructor's branches,
which every process must take alike (a collective taken by some processes only waits forever).

    python -m accelerate.commands.launch --multi_gpu --num_processes 2 --mixed_precision no \
        tests/async_distributed_server.py MODEL RESULTS_DIR PORT
"""

import json
import os
import queue
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import trl.experimental.async_grpo.async_grpo_trainer as trl_async  # noqa: E402
from accelerate import PartialState  # noqa: E402
from peft import LoraConfig  # noqa: E402

from topr_trl.asynchronous import AsyncTOPRConfig, AsyncTOPRTrainer  # noqa: E402
from topr_trl.generation.vllm_server import BACKEND  # noqa: E402
from topr_trl.runtime.distributed import end_process_group  # noqa: E402
from topr_trl.tasks.reasoning import make_reasoning_dataset, reasoning_reward  # noqa: E402


class ServerInfo(BaseHTTPRequestHandler):
    """`/server_info` of a server running the gloo weight path (all the trainer's constructor asks of it)."""

    def do_GET(self):
        body = json.dumps({"vllm_config": {"weight_transfer_config": {"backend": BACKEND}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class RolloutWorker:
    """Stands in for TRL's `AsyncRolloutWorker` (vLLM's client), which the main process builds: never started here."""

    def __init__(self, **kwargs):
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()


def main(model: str, results_dir: str, port: str) -> None:
    state = PartialState(cpu=True)
    if state.is_main_process:
        server = HTTPServer(("127.0.0.1", int(port)), ServerInfo)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    trl_async.AsyncRolloutWorker = RolloutWorker
    state.wait_for_everyone()  # the server is up before any process asks it
    args = AsyncTOPRConfig(
        output_dir=os.path.join(results_dir, "out"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_steps=1,
        report_to="none",
        token_budget=0,
        vllm_server_base_url=f"http://127.0.0.1:{port}",
    )
    trainer = AsyncTOPRTrainer(
        model,
        reasoning_reward,
        args,
        train_dataset=make_reasoning_dataset(8),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    state.wait_for_everyone()  # every process left the constructor at the same collective
    result = {
        "rank": state.process_index,
        "world": state.num_processes,
        "lora_sync": trainer._lora_sync,
        "weight_transfer": type(trainer.weight_transfer).__name__,
        "rollout_worker": type(trainer.rollout_worker).__name__,
    }
    with open(os.path.join(results_dir, f"rank{state.process_index}.json"), "w") as handle:
        json.dump(result, handle)
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
