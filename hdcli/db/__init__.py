"""The databases drafts come from: LMDB n-gram stores and how they are built.

    stores.py    the store: its format and invariants, `Store` (reading, verifying, --learn's writes)
    codec.py     records as bytes: keys, values, answer keys, each record's share of the digest
    header.py    the header record and the schema of its fields
    fingerprint.py  the tokenization a DB is valid for
    envs.py      the LMDB environments this process opened, one per file
    atomic.py    a new DB file written beside its path and renamed into place, or removed
    corpus.py    corpus files and URLs (jsonl, json, txt, parquet, csv, datasets folders)
    statsdb.py   statistics DBs: count a corpus, prune, merge shards; add counts (--learn)
    modeldb.py   model DBs: sample the target on a prompt set, index what it wrote
    cluster.py   a statistics DB build as a map-reduce on a Dask cluster
    commands.py  `hd build-stats`, `hd build-model-db`, `hd db info|query` as the CLI calls them
"""
