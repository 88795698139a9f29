"""Calibrated W8A8 (engine.quantization_calibration, job/calibration.py, engine/calibration.py) and the quality gate
(`batchgen plan --quality N`, job/plan/quality.py) on the default model's float weights in bf16."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.engine.engine_args import QUALITY_LEVERS, EngineArgs
from batchgen.engine.errors import SettingError
from batchgen.job.calibration import calibration_rows
from batchgen.job.plan.quality import RowOutcome, agreement_lines, levers_off
from batchgen.models.quantization import DEFAULT_KEEP, is_kept
from cli_runs import kill_after_parts, read, run_cli

PROMPTS = ["The capital of France is", "List three colours:", "Once upon a time,", "def add(a, b):",
           "The best way to learn is", "Water boils at", "My favourite food is", "In 1969,"]


def test_the_rows_are_evenly_spaced_and_the_same_every_time():
    assert calibration_rows(100, 4) == [0, 25, 50, 75] == calibration_rows(100, 4)
    assert calibration_rows(3, 10) == [0, 1, 2]


def test_the_defaults_are_kept_and_a_suffix_names_every_layer():
    assert DEFAULT_KEEP == ("self_attn.o_proj", "lm_head")
    assert is_kept("model.layers.7.self_attn.o_proj", DEFAULT_KEEP) and is_kept("lm_head", DEFAULT_KEEP)
    assert not is_kept("model.layers.7.self_attn.qkv_proj", DEFAULT_KEEP) and not is_kept("lm_head", None)
    from batchgen.engine.calibration import choose_keep
    chosen = choose_keep({"model.layers.0.mlp.down_proj": 0.5, "model.layers.1.mlp.down_proj": 0.001}, 0.01)
    assert chosen == ["self_attn.o_proj", "lm_head", "model.layers.0.mlp.down_proj"]


@pytest.mark.parametrize("changes, key", [({"quantization_calibration": {"rows": 4}}, "quantization_calibration"),
                                          ({"quantization": "int8", "quantization_calibration": {"rows": 0}},
                                           "quantization_calibration"),
                                          ({"quantization": "int8", "quantization_calibration": {"row": 4}},
                                           "quantization_calibration"),
                                          ({"quantization_keep": ("lm_head",)}, "quantization_keep")])
def test_a_bad_calibration_setting_names_its_key(changes, key):
    with pytest.raises(SettingError) as info:
        EngineArgs(**changes).validate()
    assert info.value.key == key and key in str(info.value)


def test_the_levers_off_are_only_those_engine_args_has():
    args, on = levers_off(EngineArgs(quantization="int8", quantization_calibration={"rows": 2}))
    assert on == ["quantization", "quantization_calibration"]
    assert args.quantization is None and args.quantization_calibration is None
    assert set(QUALITY_LEVERS) >= {"quantization", "kv_cache_dtype", "speculative"}


def test_the_gate_gives_the_agreement_over_the_rows_the_reference_decides_clearly():
    reference = {0: RowOutcome("a", -1.0, margin=2.0), 1: RowOutcome("b", -1.0, margin=0.03),
                 2: RowOutcome("c", -1.0, margin=0.5), 3: RowOutcome("d", -1.0, margin=0.3)}
    measured = {0: RowOutcome("a", -1.1), 1: RowOutcome("x", -1.0), 2: RowOutcome("c", -1.0), 3: RowOutcome("y", -2.0)}
    lines = agreement_lines(reference, measured, ["quantization"])
    assert "greedy text agrees on 2/4 rows (50.0%)" in lines[1]
    assert "1 of these rows hold a near-tie" in lines[2] and "on the 3 it decides clearly, 2/3 agree (66.7%)" in lines[2]
    decided = {row: RowOutcome(o.text, o.logprob, margin=1.0) for row, o in reference.items()}
    assert not any("near-tie" in line for line in agreement_lines(decided, measured, ["quantization"]))


def write_job(root: Path, model: Path, name: str, **engine) -> Path:
    source = root / "in.parquet"
    pq.write_table(pa.table({"key": [f"r{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS}), source)
    job = {"model": str(model), "dtype": "bfloat16",
           "input": {"path": str(source), "id_column": "key", "chat_template": False},
           "sampling": {"max_tokens": 6, "temperature": 0.0},
           "engine": {"kv_cache_memory": "256MiB", "max_num_seqs": 2, "quantization": "int8", **engine},
           "output": {"path": str(root / name), "rows_per_part": 2, "commit_interval_s": 0.1}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.slow
def test_calibration_keeps_o_proj_and_the_head_says_so_in_success_and_a_resume_keeps_the_choice(tmp_path,
                                                                                               default_model_dir):
    job = write_job(tmp_path, default_model_dir, "out", quantization_calibration={"rows": 2})
    out = tmp_path / "out"
    kill_after_parts(job, out, 1)
    cached = json.loads((out / "_calibration.json").read_text())
    assert cached["rows"] == [0, 4] and cached["keep"][:2] == ["self_attn.o_proj", "lm_head"]
    assert len(cached["sensitivity"]) == 30 * 3  # qkv, gate_up, down of each layer: o_proj and the head are kept
    # The resumed run keeps what the first one chose, not a new measurement: an extra layer written into the record
    # is kept too
    cached["keep"].append("model.layers.0.mlp.down_proj")
    (out / "_calibration.json").write_text(json.dumps(cached))
    done = run_cli(job)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "_SUCCESS").read_text())
    calibration = summary["quantization_calibration"]
    assert calibration["rows"] == [0, 4] and calibration["keep"] == cached["keep"]
    assert calibration["most_sensitive"][0] == max(cached["sensitivity"], key=cached["sensitivity"].get)
    assert summary["fingerprint"]["quantization_calibration"] == {"rows": 2}
    assert sorted(read(out)["id"].to_list()) == sorted(f"r{i}" for i in range(len(PROMPTS)))


def test_the_quality_gate_prints_text_agreement_choice_agreement_and_the_log_likelihood(tmp_path, default_model_dir):
    job = write_job(tmp_path, default_model_dir, "gate")
    spec = yaml.safe_load(job.read_text())
    spec["sampling"] = {"max_tokens": 1, "choice": ["yes", "no", "maybe"]}
    choice_job = tmp_path / "choice.yaml"
    choice_job.write_text(yaml.safe_dump(spec))
    for path, choice in ((job, False), (choice_job, True)):
        done = subprocess.run([sys.executable, "-m", "batchgen", "plan", str(path), "--quality", "3", "--no-probe"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        lines = [line for line in done.stdout.splitlines() if line.startswith("quality:")]
        assert any("greedy text agrees on" in line and "/3 rows" in line for line in lines), lines
        assert any("log-likelihood difference" in line for line in lines), lines
        assert any("choice labels agree on" in line for line in lines) == choice, lines


def test_the_plan_says_whether_calibrated_w8a8_pays_on_this_cpu_kind(tmp_path):
    from batchgen.job.plan.w8a8_advice import calibrated_w8a8_advice

    device = {"type": "cpu", "cpu": "Xeon", "cores": 2, "cpu_flags": {"amx_int8": True}}
    record = {"kind": "w8a8-calibrated", "date": "2026-12-05T18:00", "workload": {"model": "default"},
              "machine": {"cpu": "Xeon", "cores": 2, "cpu_flags": {"amx_int8": True}},
              "comparisons": {"int8": {"speedup": 0.61, "identical_share": 0.65},
                              "int8-calibrated": {"speedup": 0.56, "identical_share": 0.85}}}
    archive = tmp_path / "archive.jsonl"
    archive.write_text(json.dumps(record) + "\n")
    lines = calibrated_w8a8_advice(archive, device, "int8")
    assert "calibrated: 0.56x bf16's speed, 85% of greedy labels" in lines[3] and "does not pay" in lines[3]
    newer = {**record, "kind": "w8a8-activations", "date": "2026-12-05T17:00",
             "comparisons": {"int8-static": {"speedup": 1.31, "identical_share": 0.9}}}
    archive.write_text(json.dumps(record) + "\n" + json.dumps(newer) + "\n")
    lines = calibrated_w8a8_advice(archive, device, "int8")  # the kind comparing activations wins, older or not
    assert len(lines) == 3 and "static: 1.31x bf16's speed, 90% of greedy labels kept: pays" in lines[2]
    speed = {"kind": "w8a8-activations-speed", "date": "2026-12-05T21:00", "reference": "bf16",
             "workload": {"model": "llama-1b (random)", "name": "labeling-rows-16 + decode-32"},
             "machine": record["machine"],
             "speedup": {"bf16 / labeling": 1.0, "int8 smooth / labeling": 1.25, "int8 smooth / decode": 1.27,
                         "int8 dynamic / labeling": 1.22, "int8 dynamic / decode": 1.02}}
    stale = {**record, "workload": {"model": "llama-1b"}, "date": "2026-12-05T18:30"}  # before the newer kinds
    archive.write_text("\n".join(json.dumps(r) for r in (record, newer, stale, speed)) + "\n")
    lines = calibrated_w8a8_advice(archive, device, "int8")
    assert not any("llama-1b," in line or "llama-1b (" in line and "labeling job" in line for line in lines)
    assert "W8A8 speed on llama-1b (random) (labeling-rows-16 + decode-32" in lines[3]
    assert lines[4] == "    smooth: 1.25x on labeling, 1.27x on decode: pays on this CPU"
    assert lines[5].startswith("    dynamic: 1.22x on labeling, 1.02x on decode: does not pay")
    assert calibrated_w8a8_advice(archive, device, None) == []
    assert calibrated_w8a8_advice(archive, {**device, "cores": 8}, "int8") == []  # another CPU kind: nothing
