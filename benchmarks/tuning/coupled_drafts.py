"""Would sampled drafts be kept more often if the drafter drew them with the target's own uniform?

Seeded sampling is coupled to the output position (engine/decode/verify.py): position i's token is
the inverse CDF of the target's distribution p_i at u_i, a uniform any drafter can compute. A
drafter holding an estimate q of p_i could draft x = inverse CDF of q at the same u_i (in the
compiled draw's order, lane j % 8 then slot j // 8) instead of q's best token: lossless whatever
it drafts, and kept with P(F_q^-1(u) = F_p^-1(u)), which tends to 1 as q tends to p.

This plain sampled decode of the bundled model (T, seed per question) asks, at every position,
how often each draft equals the target's token: q's best token ("point") against q's coupled draw
("coupled"), beside the context layer's own draft (the token that followed the match), for q taken from (a) the row recorded where the longest context match (n <= 4) last
ended in the generated text, (b) the row after the previous occurrence of the last token (a
bigram recycle table), each as its top 8 tokens and the rest spread evenly, and the target's own
row (an upper bound). Acceptance only: no forward is priced.

    python benchmarks/tuning/coupled_drafts.py --questions 6
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from hdcli.engine import loader
from hdcli.engine.decode.verify import position_uniform
from hdcli.engine.text.prompts import encode_messages

QUESTIONS = Path(__file__).resolve().parent.parent / "prompts" / "user_questions.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=8, help="tokens of a recorded row kept in an estimate")
    args = ap.parse_args()
    lm = loader.load("smollm2-135m", quiet=True)
    V = int(lm.model.config.vocab_size)
    slots = (V + 7) // 8
    order = np.argsort((np.arange(V) % 8) * slots + np.arange(V) // 8)   # the compiled draw's CDF order

    def draw(p, u):
        c = np.cumsum(p[order])
        return int(order[min(np.searchsorted(c, u * c[-1], side="right"), V - 1)])

    def estimate(row):
        ids, probs = row[0][:args.top], row[1][:args.top]
        q = np.full(V, max(1e-12, 1 - probs.sum()) / (V - len(ids)))
        q[ids] = probs
        return q

    hits: dict[str, list[int]] = {}

    def count(name, ok):
        h = hits.setdefault(name, [0, 0])
        h[0] += int(ok)
        h[1] += 1

    questions = [json.loads(line) for line in open(QUESTIONS)][:args.questions]
    with torch.inference_mode():
        for qi, q in enumerate(questions):
            ids = encode_messages(lm.tokenizer, [{"role": "user", "content": q["turns"][0]}])
            cache = lm.model.new_cache()
            logits = lm.model.forward(torch.tensor([ids]), cache)[-1]
            hist, start, rows = list(ids), len(ids), {}
            for i in range(args.max_new_tokens):
                z = logits.float().numpy().astype(np.float64) / args.temperature
                p = np.exp(z - z.max())
                p /= p.sum()
                u = position_uniform(1000 + qi, i)
                y = draw(p, u)
                top = np.argsort(-p)[:args.top]
                prev = next((rows[j] for j in range(len(hist) - 2, start - 1, -1)
                             if hist[j] == hist[-1] and j in rows), None)
                match = next(((n, j) for n in (4, 3, 2, 1) for j in range(len(hist) - 2, n - 2, -1)
                              if hist[j - n + 1:j + 1] == hist[-n:]), None)
                if prev is not None:
                    count("bigram row: point", int(prev[0][0]) == y)
                    count("bigram row: coupled", draw(estimate(prev), u) == y)
                if match is not None and match[1] in rows:
                    count("context match's next token", hist[match[1] + 1] == y)   # what the context layer drafts
                    count("context match's row: point", int(rows[match[1]][0][0]) == y)
                    count("context match's row: coupled", draw(estimate(rows[match[1]]), u) == y)
                count("own row (bound): point", int(top[0]) == y)
                count("own row (bound): coupled", draw(estimate((top, p[top])), u) == y)
                rows[len(hist) - 1] = (top, p[top])
                hist.append(y)
                if y in lm.eos_ids:
                    break
                logits = lm.model.forward(torch.tensor([[y]]), cache)[-1]
    for name, (a, n) in hits.items():
        print(f"{name:32s} {a:4d}/{n:4d} = {a / n:.3f}")


if __name__ == "__main__":
    main()
