"""Does hd render a GGUF's chat template as llama.cpp renders the same file's? (issue 76, item 8)

For each conversation below, hd's prompt ids (engine/text/prompts.encode_messages: the model's
template through transformers' Jinja, special-token strings in the contents kept as text) against
llama-server's on the same GGUF: POST /apply-template (its Jinja rendering of the file's
template, with the generation prompt), then POST /tokenize with special tokens parsed (the
rendered markers are control tokens) and none added (the template writes its own BOS). Equal ids
mean a peer asked the same question gets the same prompt; the first difference is printed where
they differ. llama-server: `make llama-server` (or HD_LLAMA_SERVER).

    python benchmarks/template_check.py --models gemma3-270m,smollm2-135m \
        --out benchmarks/results/templates/llama_cpp_rendering.json
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine, write_result  # noqa: E402

from hdcli import api  # noqa: E402
from hdcli.bench.llamaserver import LlamaServer  # noqa: E402
from hdcli.engine.decode.loop import first_difference  # noqa: E402
from hdcli.engine.text.prompts import encode_messages  # noqa: E402

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system and user": [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "Name three primes."}],
    "two turns": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
                  {"role": "user", "content": "Write a haiku about rain.\nKeep it short."}],
    "unicode and markup": [{"role": "user", "content": "Translate «naïve café» to German; use *bold* and `code`."}],
}


def post(server: LlamaServer, route: str, body: dict) -> dict:
    req = urllib.request.Request(server.url + route, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def check(name: str) -> dict:
    lm = api.load_model(name, quiet=True)
    server = LlamaServer("llama-server", lm)
    out = {"source": str(lm.source), "llama_server": server.settings(), "conversations": {}}
    try:
        for label, messages in CONVERSATIONS.items():
            ours = encode_messages(lm.tokenizer, messages, chat=True)
            text = post(server, "/apply-template", {"messages": messages})["prompt"]
            theirs = post(server, "/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]
            at = first_difference(ours, theirs)
            row = {"equal": at is None, "hd_tokens": len(ours), "llama_cpp_tokens": len(theirs),
                   "llama_cpp_text": text}
            if at is not None:
                row |= {"first_difference": at, "hd_there": lm.tokenizer.decode(ours[at:at + 8]),
                        "llama_cpp_there": lm.tokenizer.decode(theirs[at:at + 8])}
            out["conversations"][label] = row
            print(f"{name} / {label}: " + ("the same ids" if at is None else
                  f"differ at token {at}: hd {row['hd_there']!r}, llama.cpp {row['llama_cpp_there']!r}"))
    finally:
        server.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gemma3-270m,smollm2-135m")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    doc = {"command": command_line("benchmarks/template_check.py", args), "machine": machine(), "models": {}}
    for name in args.models.split(","):
        doc["models"][name] = check(name)
    write_result(Path(args.out) if args.out else None, doc)
    return 0 if all(c["equal"] for m in doc["models"].values() for c in m["conversations"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
