"""python -m batchgen.bench [JOB.yaml] [options]: the same as `batchgen bench`;
python -m batchgen.bench --gpu [options]: the GPU check (batchgen/bench/gpu/), which needs only torch, transformers
and triton."""
import sys

if __name__ == "__main__":
    if "--gpu" in sys.argv[1:]:
        from batchgen.bench.gpu.check import main
        sys.exit(main([arg for arg in sys.argv[1:] if arg != "--gpu"]))
    from batchgen.bench.command import bench
    bench(prog_name="python -m batchgen.bench")
