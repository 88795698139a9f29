"""The output columns are defined once (batchgen/job/output/schema.py): the schema, the part writer and the README's output
table all follow that table."""
from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.engine.request import Result
from batchgen.job.output.schema import (COLUMNS, KEEP_COLUMNS_ROW, OUTPUT_COLUMNS, ROW_POSITION_ID_TYPE, markdown_rows,
                                 output_schema)
from batchgen.job.output.part_writer import PartWriter
from batchgen.job.output.output_dir import OutputDir

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_output_table() -> list[tuple[str, str, str]]:
    """The rows (column, type, meaning) of the README table whose header is `| column | type | meaning |`."""
    lines = README.read_text().splitlines()
    start = lines.index("| column | type | meaning |")
    assert re.fullmatch(r"\|(-+\|){3}", lines[start + 1]), lines[start + 1]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, line
        rows.append(tuple(cells))
    return rows


def test_readme_output_table_matches_the_columns():
    table = readme_output_table()
    expected = [c.table_row for c in COLUMNS] + [KEEP_COLUMNS_ROW]
    names = [row[0] for row in table]
    assert names == [row[0] for row in expected], "README column names or order differ"
    assert table == expected, "README output table differs; it should read:\n" + "\n".join(markdown_rows())


def test_readme_types_name_the_arrow_types():
    assert COLUMNS[0].type_text == "as `input.id_column` (int64 for row positions)"
    by_name = {c.name: c.type_text for c in COLUMNS}
    assert by_name["error"] == "string, null" and by_name["e2e_s"] == "float64"
    assert by_name["first_token_time"] == "timestamp[us, UTC], null"


ALWAYS = [c for c in COLUMNS if c.only is None and "generate" in c.tasks]  # a generate job's unconditional columns


def test_the_names_the_config_reads_are_the_tables():
    """column_names.py holds the names alone (a leaf the config imports): they must be the table's, in its order."""
    assert OUTPUT_COLUMNS == tuple(column.name for column in COLUMNS)


def test_schema_follows_the_columns():
    schema = output_schema(pa.string(), [("tag", pa.int32())])
    assert schema.names == [c.name for c in ALWAYS] + ["tag"]
    assert set(OUTPUT_COLUMNS) - set(schema.names) == {
        "sample_index", "choice_probs", "logprobs", "top_logprobs", "json", "lora", "replica",  # the conditional ones
        "embedding", "label", "probs", "score", "logprob_sum", "num_scored_tokens", "perplexity", "token_logprobs",
        "num_truncated_tokens"}  # and the other tasks' (tests/test_task_config.py)
    assert schema.field("id").type == pa.string()
    assert [schema.field(c.name).type for c in ALWAYS[1:]] == [c.type for c in ALWAYS[1:]]
    assert all(field.nullable for field in schema)  # `nullable` in the table is documentation only
    assert output_schema(ROW_POSITION_ID_TYPE, []).field("id").type == pa.int64()


def test_writer_reads_every_column_from_the_result(tmp_path):
    t0 = 1_700_000_000.0
    result = Result(request_id=3, text="hi", token_ids=[5, 6, 7], finish_reason="stop", error=None,
                    prompt_tokens=9, output_tokens=3, cached_tokens=4, num_preemptions=2, arrival_time=t0,
                    first_scheduled_time=t0 + 0.5, first_token_time=t0 + 1.0, finish_time=t0 + 2.0)
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    out.prepare_tmp()
    writer = PartWriter(out, output_schema(pa.string(), [("tag", pa.int64())]), "{}", 10, 60.0, True)
    writer.add(3, "row-3", (42,), result)
    writer.commit()
    row = pq.read_table(out.run_parts()[0]).to_pylist()[0]
    assert row["id"] == "row-3" and row["tag"] == 42 and row["_row"] == 3
    for column in ALWAYS[1:]:
        value = getattr(result, column.name)
        if pa.types.is_timestamp(column.type):
            assert row[column.name].timestamp() == value, column.name
        else:
            assert row[column.name] == value, column.name
