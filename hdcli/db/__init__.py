"""The databases drafts come from: LMDB n-gram stores and how they are built.

    stores.py    the store format (keys, values, header, content digest), reading and writing
    corpus.py    corpus files and URLs (jsonl, json, txt, parquet, csv, datasets folders)
    statsdb.py   statistics DBs: count a corpus, prune, merge shards; add counts (--learn)
    modeldb.py   model DBs: sample the target on a prompt set, index what it wrote
    cluster.py   a statistics DB build as a map-reduce on a Dask cluster
"""
