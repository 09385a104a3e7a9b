"""Private alias of the old path: the Arrow readers moved to :mod:`lit_seqpack.data.sources._arrow`."""

from lit_seqpack.data.sources._arrow import hf_disk_table, parquet_table, table_to_arrays

__all__ = ["hf_disk_table", "parquet_table", "table_to_arrays"]
