"""The decode loop: draft, verify every drafted token in one target forward, accept, repeat.

    request.py     Request: what one generation asks for (prompt, max new tokens, sampling, ...)
    loop.py        Decoder, Stream and Generation: the loop itself (one step of one or several
                   streams: speculative_steps; of one: speculative_step)
    draft.py       the Drafter interface the loop asks, and the Draft it gets back
    prediction.py  predicted outputs (OpenAI's `prediction`) as the top drafting layer
    tree.py        candidates merged into a token tree, cut to what pays; the tree forward
    verify.py      the acceptance rules (greedy and sampling), both lossless
    batch.py       several generations verified in one forward
    prefix.py      exact prefix caching of prompts and answers
    costs.py       the forward cost by width, measured once per model and machine, cached
    calibrate.py   the M-invariant mode's calibration and self-check on a loaded model
    stats.py       what one generation records: per layer and per step
"""
