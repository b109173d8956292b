"""Data: rows from JSONL / JSON / Parquet files or prepared TFDS datasets (sources.py), and code
problems' tests in every layout the datasets use, read into one form (code_tests.py)."""

from oapl_jax.data.code_tests import from_livecodebench, metadata_func_name, parse_tests
from oapl_jax.data.sources import (BadRowError, RowReport, dedup, host_shard, is_tfds,
                                   normalize_text, read_rows, select)

__all__ = ["BadRowError", "RowReport", "dedup", "from_livecodebench", "host_shard", "is_tfds",
           "metadata_func_name", "normalize_text", "parse_tests", "read_rows", "select"]
