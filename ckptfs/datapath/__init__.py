"""The data path inside a mount: staging segments and extent maps (staging.py), the journal
(journal.py), the flusher (flusher.py), the read path and its readahead (reader.py), the
chunk cache it reads through (readcache.py) and its loader threads (loaders.py)."""
