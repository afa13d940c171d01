"""Draft models for the model hierarchy: any model sharing the target's tokenizer, or a self-draft.

Names (`--draft-models A,B`, smallest first):
  self:blocks=K   the target's first K decoder blocks (transformer layers), its final norm and
                  head: a real, smaller model of the same family (weights copied, the target is
                  untouched); self:layers=K is its older spelling, still taken ("layer" is hd's
                  word for a drafting source);
  self:int8       the target with every Linear layer dynamically quantised to int8
                  (torch.ao.quantization.quantize_dynamic; CPU only, computes in fp32);
  anything else   loaded like a target (bundled name, .gguf, folder, hub id) and refused unless
                  its tokenizer is the target's (same vocabulary and special tokens).
"""
from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass

import torch

from ..db.fingerprint import tokenizer_fingerprint
from ..engine.kernels import dense as kernels
from ..engine import loader
from ..engine.model import is_owned
from ..engine.model.target import TargetModel, TransformersForward
from ..errors import HdError


@dataclass
class DraftModel:
    name: str
    model: TargetModel
    load_seconds: float
    params: int


def _count(model: TargetModel) -> int:
    module = model.module
    packed = sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, kernels.PackedLinear))
    return sum(p.numel() for p in module.parameters()) + packed


def truncated(target: TargetModel, k: int) -> TargetModel:
    """A copy of a decoder-only model keeping its first k blocks (and embeddings, norm, head)."""
    n = int(target.config.num_hidden_layers)
    if not 1 <= k < n:
        raise HdError(f"self:blocks={k}: the target has {n} blocks, pass 1 <= K < {n}")
    if is_owned(target):   # hd's own forward: its first k blocks, shared, not copied
        return target.truncated(k)
    model = target.module
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = k
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:k]
    small = type(model)(cfg)
    keep = {}
    for key, value in model.state_dict().items():
        m = re.search(r"\.layers\.(\d+)\.", key)
        if m is None or int(m.group(1)) < k:
            keep[key] = value
    missing, unexpected = small.load_state_dict(keep, strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise HdError(f"self:blocks={k}: cannot slice this architecture (missing {missing[:2]})")
    small = small.to(dtype=model.dtype, device=next(model.parameters()).device).eval()
    if kernels.is_packed(model):  # as fast per token as its target
        kernels.pack(small)
    return TransformersForward(small)


def int8(model: TargetModel, target=None) -> TargetModel:
    """Dynamic int8 quantisation of the Linear layers (weights int8, activations quantised on the
    fly). CPU only; the copy computes in fp32 whatever the target's dtype. An owned forward's
    copy is loaded from its file with dense fp32 weights, one tensor at a time, then quantised."""
    if model.device.type != "cpu":
        raise HdError("self:int8 is CPU only (torch dynamic quantisation); use self:blocks=K on CUDA")
    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError:  # pragma: no cover
        raise HdError("self:int8 needs torch.ao.quantization, missing from this torch") from None
    owned = is_owned(model)
    if owned:
        base = loader.load(target.name, dtype="fp32", device="cpu", kernels="torch", invariant="off", quiet=True).model
    else:
        base = copy.deepcopy(model.module)
        kernels.unpack(base)  # torch.ao quantises nn.Linear layers only
        base = base.float()
    import warnings
    with warnings.catch_warnings():   # torch.ao's deprecation notices are torch's to its callers, not the user's
        warnings.simplefilter("ignore")
        small = quantize_dynamic(base, {torch.nn.Linear}, dtype=torch.qint8).eval()
    return small if owned else TransformersForward(small)


def same_tokenizer(a, b) -> bool:
    return tokenizer_fingerprint(a) == tokenizer_fingerprint(b)


def load(name: str, target: loader.LoadedModel) -> DraftModel:
    t0 = time.perf_counter()
    name = name.strip()
    if name.startswith("self:"):
        spec = name[5:]
        if spec == "int8":
            m = int8(target.model, target)
        elif spec.startswith(("blocks=", "layers=")):
            try:
                k = int(spec.partition("=")[2])
            except ValueError:
                raise HdError(f"draft model '{name}': write self:blocks=K with K a number") from None
            m = truncated(target.model, k)
        else:
            raise HdError(f"unknown self-draft '{name}': use self:blocks=K or self:int8")
        return DraftModel(name, m, time.perf_counter() - t0, _count(m))
    # the draft's own kernels (a GGUF's blocks for a GGUF draft), in the target's dtype; a draft
    # only proposes: the plain forward will do
    lm = loader.load(name, dtype=target.dtype, device=target.device, invariant="off")
    if not same_tokenizer(lm.tokenizer, target.tokenizer):
        raise HdError(f"draft model '{name}' has another tokenizer than the target '{target.name}': "
                      "a draft must tokenize exactly like its target")
    return DraftModel(name, lm.model, time.perf_counter() - t0, _count(lm.model))

