"""What a measurement was taken on: every printed and saved figure of the command line records it, because the
thread count and the CPU's vector instructions change the numbers of a CPU run (README.md, "What to expect")."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what the platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """torch version, CPU model, the vector instructions torch's CPU kernels use, threads, and the GPU if any."""
    info = {
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def describe_machine(info: dict | None = None) -> str:
    """One line: 'torch 2.13.0+cpu, Intel Xeon ... (AVX512), 2 threads'."""
    info = info or machine_info()
    text = f"torch {info['torch']}, {info['cpu']} ({info['cpu_capability']}), {info['threads']} threads"
    return text + (f", GPU {info['gpu']}" if "gpu" in info else "")
