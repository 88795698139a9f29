"""`batchgen bench`: batchgen against transformers (static and continuous batching) and vLLM's CPU build, on the
same rows in the same run, greedy; JSON record, PNG chart and a performance archive (`harness.run_bench`).
`gpu/` is the GPU check (`python -m batchgen.bench --gpu`). Nothing is
imported here, so that the GPU check runs on a machine that has only torch, transformers and triton."""
