"""The data path inside a mount: staging segments and extent maps (staging.py), the journal
(journal.py), the flusher (flusher.py), the read path with its chunk cache and readahead
(reader.py)."""
