"""The engine: the target model and the loop that verifies drafts with it.

    models.py    load the target (bundled name, GGUF, folder, Hugging Face id): which forward runs
                 it (hd's own for the llama family and Gemma 3, else transformers'), dtype, device
    forward/     hd's own forward per model family, from a GGUF or a transformers checkpoint
    kvcache.py   its KV cache, in the form the invariant attention reads
    quants.py    the GGUF GEMMs: a GGUF's weights multiplied in their own blocks (csrc/qmm.cpp)
    kernels.py   oneDNN-packed dense Linear layers; the --kernels values
    invariant.py the M-invariant forward: every verified row bit-equal to its one-token forward
    fused.py     its attention as one compiled function (csrc/attend.cpp)
    batch.py     several generations verified in one forward
    costs.py     the forward cost by width, measured once per model and machine, cached
    draft.py     the Drafter interface the loop asks, and the Draft it gets back
    tree.py      candidates merged into a token tree, cut to what pays; the tree forward
    verify.py    the acceptance rules (greedy and sampling), both lossless
    decode.py    the decode loop: draft, verify in one forward, accept, keep the path, repeat
    prompts.py   prompt -> token ids (chat template); tokens -> text pieces; stop strings
    tools.py     tool calls: tools checked, rendered into the prompt, call grammars, calls parsed back
    stats.py     what one generation records: per layer and per step

Nothing here imports from the packages above it (db, drafting, hsd, bench).
"""
