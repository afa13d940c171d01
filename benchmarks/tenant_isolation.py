"""Does what one API key's requests taught `hd serve --learn` make another key's requests faster?

The timing side channel of issue 39: output never changes, but a request whose text another
tenant already generated is drafted from it and completes faster. Reproduces the probe: key
"alice" asks unusual prompts; then "bob" asks the same prompts, "carol" (never met them) asks them
too, and alice repeats them. Per request: seconds per completion token (latency / tokens),
accepted tokens per verification step (usage.hd) and which layers drafted. Run once with
`--learn-scope shared` (the leak) and once with `--learn-scope key` (the default with several
keys), each on a fresh copy of the model DB, then once more after a restart of the key-scoped
server on the DB it wrote (alice's answers are on disk, tagged with her scope).

    python benchmarks/tenant_isolation.py --model-db model.lmdb --out benchmarks/results/serve/tenants.json

Greedy, 128 new tokens; bob and carol take turns going first on each prompt (drift hits both).
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine, write_result  # noqa: E402

# unusual requests: their answers are in no corpus the model DB was built from
PROMPTS = [
    "Write a limerick about a purple giraffe named Zorblax who collects antique spoons.",
    "Describe the rules of a made-up sport called quadrant-ball, played on ice with three goals.",
    "Invent a recipe for a soup made of pears, smoked paprika and black lentils, step by step.",
    "Write a short diary entry of a lighthouse keeper on the planet Neptune who befriends a comet.",
    "List five names for a bakery run by retired astronauts, each with a one-line slogan.",
    "Explain how a clockwork owl that sorts letters by smell might be built, part by part.",
]
KEYS = {"alice": "KEY-A", "bob": "KEY-B", "carol": "KEY-C", "dave": "KEY-D"}


class Server:
    def __init__(self, args):
        from hdcli.serve.spawn import spawn
        import openai
        self.proc, self.url, self.log = spawn(args)
        self.clients = {who: openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=600)
                        for who, key in KEYS.items()}
        self.name = self.clients["alice"].models.list().data[0].id

    def ask(self, who: str, prompt: str, n: int) -> dict:
        t0 = time.perf_counter()
        r = self.clients[who].chat.completions.create(
            model=self.name, messages=[{"role": "user", "content": prompt}], max_tokens=n, temperature=0)
        dt = time.perf_counter() - t0
        hd = r.usage.model_extra["hd"]
        return {"who": who, "tokens": r.usage.completion_tokens, "seconds": dt,
                "s_per_token": dt / max(r.usage.completion_tokens, 1),
                "accepted_per_step": hd["mean_accepted_tokens"],
                "layers": {k: v["accepted"] for k, v in hd["layers"].items()}, "text": r.choices[0].message.content}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=300)


def run(server: Server, n: int, teach: bool, others=("bob", "carol")) -> list[dict]:
    rows = []
    for i, p in enumerate(PROMPTS):
        if teach:
            rows.append(server.ask("alice", p, n) | {"prompt": i, "round": "teach"})
            time.sleep(0.5)   # the learner writes alice's answer
        pair = list(others) if i % 2 == 0 else list(others)[::-1]
        for who in pair:
            rows.append(server.ask(who, p, n) | {"prompt": i, "round": "other"})
        rows.append(server.ask("alice", p, n) | {"prompt": i, "round": "repeat"})
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for label, pick in [("alice_teach", lambda r: r["who"] == "alice" and r["round"] == "teach"),
                        ("alice_repeat", lambda r: r["who"] == "alice" and r["round"] == "repeat"),
                        ("bob", lambda r: r["who"] == "bob"), ("carol", lambda r: r["who"] == "carol"),
                        ("dave", lambda r: r["who"] == "dave")]:
        sel = [r for r in rows if pick(r)]
        if sel:
            out[label] = {"s_per_token": statistics.mean(r["s_per_token"] for r in sel),
                          "s_per_token_median": statistics.median(r["s_per_token"] for r in sel),
                          "accepted_per_step": statistics.mean(r["accepted_per_step"] for r in sel),
                          "model_layer_accepted": sum(r["layers"].get("model", 0) for r in sel),
                          "recycle_layer_accepted": sum(r["layers"].get("recycle", 0) for r in sel)}
    b, c = out.get("bob"), out.get("carol")
    if b and c:
        out["bob_over_carol_time"] = b["s_per_token"] / c["s_per_token"]
        per = [rb["s_per_token"] / rc["s_per_token"] for rb, rc in
               zip([r for r in rows if r["who"] == "bob"], [r for r in rows if r["who"] == "carol"])]
        out["bob_over_carol_per_prompt"] = per
        out["bob_over_carol_median"] = statistics.median(per)   # robust to one disturbed request
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-db", required=True)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    keys = tmp / "keys"
    keys.write_text("".join(f"{who} {key}\n" for who, key in KEYS.items()))
    doc = {"command": command_line("benchmarks/tenant_isolation.py", args), "machine": machine(), "runs": {}}
    for scope in ("shared", "key"):
        db = tmp / f"{scope}.lmdb"
        shutil.copy(args.model_db, db)
        base = ["--model", args.model, "--model-db", str(db), "--learn", "--api-keys-file", str(keys),
                "--learn-scope", scope]
        s = Server(base)
        rows = run(s, args.n, teach=True)
        s.stop()
        doc["runs"][scope] = {"rows": rows, "summary": summary(rows)}
        print(scope, json.dumps(doc["runs"][scope]["summary"], indent=1), file=sys.stderr)
        if scope == "key":   # after a restart: alice's answers come back from the DB, hers alone;
            # dave never asked anything (bob and carol did: their own answers came back too)
            s = Server(base)
            rows = run(s, args.n, teach=False, others=("dave",))
            s.stop()
            doc["runs"]["key_after_restart"] = {"rows": rows, "summary": summary(rows)}
            print("after restart", json.dumps(doc["runs"]["key_after_restart"]["summary"], indent=1), file=sys.stderr)
    write_result(args.out, doc)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
