"""The GPU check: batchgen on one CUDA device, in four steps that each write their JSON as soon as they end, so a
run cut short still returns what finished:
  0. environment: the GPU, its driver, python/torch/triton/transformers, a C compiler and Python's headers (Triton
     builds its launcher with them), libcuda;
  1. the Triton kernel tests and the CUDA-only tests, run by pytest on the device (the first real execution of the
     bf16 tensor-core path: the interpreter widens bf16 dots to fp32). They are the checkout's test suite: this step
     runs only when the check runs from a checkout's root (bench/checkout.py), and is skipped, saying so, from an
     installed batchgen;
  2. greedy equality with transformers on the same device, on random weights of Llama-3.2-1B's shape, in bf16 (and
     fp32 in a full run);
  3. output tokens/s against transformers' static batching, and decode step times against their floor.
Each step runs in its own process under a time budget (steps.py); a step that fails or is stopped records why, and
the next one runs. Nothing but batchgen is needed: no network, no tokenizer, no installs (torch, transformers,
triton, numpy, safetensors, pytest).

    PYTHONPATH=.:kernels python -m batchgen.bench --gpu [--quick]      # full: 8 min at most; --quick: under 4
    PYTHONPATH=.:kernels python -m batchgen.bench --gpu --dry-run      # the same flow on the CPU (CI)

check.py is the command and orchestrate.py runs the steps (step_environment.py, step_kernel_tests.py with its
pytest plugin pytest_record.py, step_greedy.py, step_throughput.py), each writing through step_record.py;
options.py has each mode's settings, batchgen_side.py and transformers_side.py run the two systems, shapes.py has
the models and their decode-step floors, device.py the device's measured rates, report.py the closing table.
"""
