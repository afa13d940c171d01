"""The `hd` commands' own functions, as the CLI and the Python API call them: each puts a run of
the layers below together (compose, generation) for one command: `hd generate` (generate.py),
`hd build-stats`, `hd build-model-db`, `hd db info|query` (db.py), `hd plan` (plan.py) and
`hd bench` (bench.py)."""
