"""What `hd costs` shows: a model's forward-cost curve as it loads with the given options on this
machine (engine/decode/costs.py), with the attention and the GGUF GEMMs' activations it runs."""
from __future__ import annotations

import torch

from . import loader
from . import records
from .decode import costs
from .kernels import invariant as attention_choice
from .kernels import quants


def layers_call(model) -> dict:
    """{"compiled": True} where the model's decoder blocks run as one compiled call, else
    {"compiled": False, "why": ...} (compiled.why_not; transformers' forward has blocks of its own)."""
    from .model import is_owned
    from .model.attention import attends_fused
    from .model.compiled import why_not
    why = why_not(model) if is_owned(model) else "transformers' forward"
    if why is None and not attends_fused(model, model.device):
        why = "its attention is not the fused one, which the compiled call runs (model/attention.py: Step)"
    return {"compiled": True} if why is None else {"compiled": False, "why": why}


def cost_report(model: str = loader.DEFAULT_MODEL, dtype: str = "auto", device: str = "auto",
                kernels: str = "auto", remeasure: bool = False, quiet: bool = False,
                invariant: str = "auto") -> dict:
    """What `hd costs` shows: the forward-cost curve of the model as it loads with these options
    on this machine (cached, or measured now; measured again with remeasure)."""
    lm = loader.load(model, dtype=dtype, device=device, kernels=kernels, quiet=quiet, invariant=invariant)
    dt = lm.dtype
    curves = {lm.kernels: costs.curve_for(lm, remeasure=remeasure, quiet=quiet)}
    out = {"model": lm.name, "source": lm.source, "dtype": dt, "device": lm.device, "cpu": records.cpu_name(),
           "threads": torch.get_num_threads(), "kernels": lm.kernels, "forward": lm.info.get("forward"),
           "invariant": lm.invariant,
           # which attention the M-invariant forward uses, and the times it was chosen by (decided
           # once per process, when the model loaded)
           "attention": attention_choice.decide(lm.model) if lm.invariant else None,
           # whether the decoder blocks run as one compiled call (model/compiled.py), else why not
           "layers": layers_call(lm.model),
           "curves": {},
           "cache": str(records.cache_root()), "max_age_days": costs.MAX_AGE_DAYS}
    if lm.kernels in ("gguf", "gguf-int8") and lm.device == "cpu":
        # which activations the GGUF GEMMs take here, and the times why
        out["activation_choice"] = {k: v for k, v in quants.activation_choice().items() if k != "key"}
    for k, c in curves.items():
        if c is None:
            continue
        out["curves"][k] = {"one_token_ms": None if c.one_token_seconds is None else 1e3 * c.one_token_seconds,
                            "cost": c.to_dict(), "verifies_cheaply": c.verifies_cheaply(),
                            "branch": c.branch, "stream": c.stream,
                            "measured_at": c.info.get("measured_at"),
                            "plausible": c.info.get("plausible", True)}
    return out
