"""Training data: ``TokenDataset`` (``dataset``), JSONL/parquet token records and the
deterministic batch order (``records``), chat transcripts through a tokenizer (``chat``)."""
