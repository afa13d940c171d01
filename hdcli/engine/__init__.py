"""The engine: the target model and the loop that verifies drafts with it, in rooms.

    environment.py  the environment variables hd reads, in one place
    progress.py     progress bars on stderr: in place on a terminal, whole lines in a log
    records.py      measurement records kept under HD_CACHE_DIR (cost curves, calibrations, timings)
    kernels/        the arithmetic under hd's own forward: GGUF GEMMs, oneDNN dense layers, the
                    invariant and compiled attentions, the C++ extension build (csrc/)
    model/          hd's own forward per model family, its KV cache and numerics; TargetModel
    text/           prompts and chat templates, tools, grammar constraints
    decode/         the decode loop, token trees, acceptance, batched verification, prefix cache,
                    forward costs, the Drafter interface, run statistics
    loader.py       load the target (bundled name, GGUF, folder, Hugging Face id): which forward
                    runs it, dtype, device
    cost_report.py  what `hd costs` shows: a loaded model's forward-cost curve and kernel choices

Every module is mapped in docs/architecture.md. Nothing here imports from the packages above it
(db, drafting, hsd, bench).
"""
