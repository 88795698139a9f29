"""python -m batchgen.bench [JOB.yaml] [options]: the same as `batchgen bench`."""
from batchgen.cli import bench

if __name__ == "__main__":
    bench(prog_name="python -m batchgen.bench")
