"""Data sources: rows from JSONL / JSON / Parquet files or prepared TFDS datasets (sources.py)."""

from oapl_jax.data.sources import (BadRowError, RowReport, dedup, is_tfds, normalize_text,
                                   read_rows, select)

__all__ = ["BadRowError", "RowReport", "dedup", "is_tfds", "normalize_text", "read_rows", "select"]
