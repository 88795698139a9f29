"""The GPU check: batchgen on one CUDA device, with random-weight Llama models of real shapes built in the run.

For each model (Llama-3.2-1B's shape, then Llama-3.1-8B's), saved with save_pretrained in bf16 to a temp dir:
  1. greedy equality with transformers on the same GPU, for a few random-token prompts, alone and batched: in bf16
     every divergence must be a near-tie (the two tokens within a couple of bf16 ulps in transformers' own logits);
     for the small model also in fp32, under the tests' rule (batchgen/bench/greedy_check.py: within 1e-3, at most
     1 prompt in 20);
  2. output tokens/s on a synthetic offline workload (ignore_eos, random prompts), against transformers' `generate`
     with static batching (rows sorted by length, left-padded) on a random subset of the same workload;
  3. the decode step time at batch sizes 1, 32 and 256 against its floor: max(bytes read per step (weights + the
     batch's KV) / measured copy bandwidth, FLOPs per step / measured bf16 matmul rate).
It prints one short table last and writes every figure as JSON (--out). Nothing but the tree: no network, no
tokenizer, no installs (torch, transformers, triton, numpy, safetensors).

    PYTHONPATH=.:kernels python -m batchgen.bench --gpu [--quick]
    PYTHONPATH=.:kernels python -m batchgen.bench.gpu [--quick]      # the same

check.py is the command; model_check.py checks one model, with batchgen_side.py and transformers_side.py running
the two systems, shapes.py the models and their decode-step floors, device.py the device's measured rates and
report.py the phases, verdicts and closing table.
"""
