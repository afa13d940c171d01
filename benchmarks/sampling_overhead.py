"""Plain decoding's time outside the target's forward, greedy and sampled (issue 50: sampling cheap).

Plain decoding (no drafts) of --tokens tokens from one prompt, best of --repeats per setting:
the share of each step's time outside the forward (RunStats.overhead_share) and those
milliseconds. Sampling chooses the token with verify.coupled_choice (the inverse CDF at the output
position's uniform, top-k/top-p on the candidates only).

    python benchmarks/sampling_overhead.py --out benchmarks/results/sampling_overhead.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import command_line, machine, write_result  # noqa: E402

from hdcli import api  # noqa: E402
from hdcli.config import DecodingConfig  # noqa: E402
from hdcli.engine.decode.loop import Decoder  # noqa: E402
from hdcli.engine.decode.verify import Sampling  # noqa: E402
from hdcli.engine.text.prompts import encode_prompt  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SETTINGS = {"greedy": Sampling(), "t0.7": Sampling(temperature=0.7),
            "t0.7-p0.95": Sampling(temperature=0.7, top_p=0.95),
            "t0.7-k40-p0.95": Sampling(temperature=0.7, top_k=40, top_p=0.95)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lm = api.load_model_for(DecodingConfig(model=args.model).validate(), quiet=True)
    ids = [int(t) for t in encode_prompt(lm.tokenizer, PROMPT)]
    dec = Decoder(lm.model, ())
    rows = {}
    for name, s in SETTINGS.items():
        dec.generate(ids, max_new_tokens=8, sampling=s, seed=0)   # warm
        runs = []
        for rep in range(args.repeats):
            st = dec.generate(ids, max_new_tokens=args.tokens, sampling=s, seed=rep).stats
            runs.append({"overhead_share": st.overhead_share,
                         "outside_ms_per_step": 1e3 * (st.draft_seconds + st.bookkeeping_seconds) / st.steps,
                         "forward_ms_per_step": 1e3 * st.forward_seconds / st.steps})
        rows[name] = min(runs, key=lambda r: r["overhead_share"])
        print(f"{name:>16}: outside the forward {rows[name]['overhead_share']:.1%} "
              f"({rows[name]['outside_ms_per_step']:.2f} ms a step; forward {rows[name]['forward_ms_per_step']:.1f} ms)",
              file=sys.stderr)
    write_result(args.out, {"command": command_line("sampling_overhead.py", args), "machine": machine(), "model": args.model,
                            "tokens": args.tokens, "best_of": args.repeats, "settings": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
