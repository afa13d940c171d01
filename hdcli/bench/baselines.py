"""The baselines users already have, run in the same process as hd: transformers' own
`generate()` on the stock model (greedy, or with its prompt lookup decoding), and the comparison
of two outputs token by token."""
from __future__ import annotations

from typing import Sequence

from ..engine import loader
from ..engine.decode.verify import Sampling
from ..engine.model import is_owned


def stock_model(lm: loader.LoadedModel) -> loader.LoadedModel:
    """The same model with torch's own kernels and its stock forward, as transformers ships it: lm
    itself where it already is, else transformers' model of the same file or folder."""
    if not is_owned(lm.model) and lm.kernels == "torch":
        return lm
    return loader.load_reference(lm.name, lm.dtype, lm.device)


def hf_generate(lm: loader.LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int,
                sampling: Sampling = Sampling(), seed: int | None = None,
                prompt_lookup: int | None = None) -> tuple[list[int], float]:
    """transformers' own generate() on lm (greedy, or sampling with the same settings), with its
    prompt lookup decoding when prompt_lookup is given: the baselines users have. Returns (new
    tokens, wall seconds, prefill included)."""
    import time
    import torch
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=sorted(lm.eos_ids) or None,
                  pad_token_id=lm.tokenizer.pad_token_id or (sorted(lm.eos_ids) or [0])[0])
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    if sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                      top_k=sampling.top_k or None)
        torch.manual_seed(seed or 0)
    ids = torch.tensor([list(prompt_ids)], device=lm.model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.module.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0
