"""The dataset file formats qlora reads, by suffix: the one home of the list that a hub download fetches
and qlora_cli/data/files.py reads."""

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
# The text formats may come gzip-compressed (`rows.jsonl.gz`), as `datasets` reads them; Parquet and
# Arrow compress their own columns, so a `.parquet.gz` is no format qlora reads.
GZIP = ".gz"
DATA_SUFFIXES = (*FORMATS, *(suffix + GZIP for suffix, name in FORMATS.items() if name in ("json", "csv")))
