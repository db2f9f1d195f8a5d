"""The machine a run is on: what accelerate and DeepSpeed need (`distributed`) and what every figure
records of the CPU, threads and kernels (`machine`)."""
