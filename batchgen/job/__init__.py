"""The job layer: job.yaml -> Parquet input -> engine -> Parquet output, resumable. Knows nothing of blocks or
tensors; the engine knows nothing of Parquet or YAML."""
from .config import JobConfig, JobConfigError, load_job, parse_job
from .runner import PreparedJob, Progress, execute_job, prepare_job

__all__ = ["JobConfig", "JobConfigError", "PreparedJob", "Progress", "execute_job", "load_job", "parse_job",
           "prepare_job"]
