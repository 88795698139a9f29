"""The job layer: a job file in, a finished output directory out (docs/architecture.md draws the way).

    job_file.py          the job file read (bounded) and its --set overrides applied
    config.py, keys.py   the job, parsed and checked (settings derived from the engine's dataclasses)
    input/               input files, reading rows, building and tokenizing prompts
    prepare.py           the checks that need no model, the fingerprint, the output's lock, the engine settings
    executors/           local (one engine here) or ray (engine replicas): rows in, each row's results out
    output/              the column table, the output store (a directory or an object prefix) and its ledger,
                         the part writer, the output check, the final rewrite
    runner.py            execute_job: an executor into the part writer, then _SUCCESS
    plan/                `batchgen plan`: what a run would do, without running it
"""
from .config import JobConfig, JobConfigError, load_job, parse_job
from .keys import OutputBusy
from .prepare import PreparedJob, prepare_job
from .runner import Progress, execute_job
