"""Benchmarks users can re-run: Spec-Bench with hd's methods and the peers, in one process.

    specbench.py   the question set: find, load, select by category
    runner.py      methods (hd's and the peers'), interleaved runs, the summary and saved answers
    report.py      the tables and the speedup chart; a saved run read back
    baselines.py   transformers' own generate() on the stock model: what users run today
    llamacpp.py    llama.cpp on the same GGUF (llama-cpp-python, optional): the CPU yardstick
    llamaserver.py llama.cpp's llama-server on the same GGUF, plain and with its own n-gram speculation
    agents.py      `hd bench agents`: tool calls, JSON and edits, each method under the same constraint
    drafts.py      `hd bench drafts`: drafting configurations replayed over recorded greedy answers
    commands.py    `hd bench spec-bench`, `hd bench agents` and `hd bench drafts` as the CLI calls them
"""
from . import drafts
from .runner import (METHOD_HELP, METHODS, HfGenerate, LlamaServerPeer, Runner, Turn, check_methods, close,
                     method_help, default_methods, machine, make_runners, method_config, run, run_question, save,
                     summarize, unavailable)

__all__ = ["METHOD_HELP", "METHODS", "HfGenerate", "LlamaServerPeer", "Runner", "Turn", "check_methods",
           "close", "drafts",
           "method_help", "default_methods", "machine", "make_runners", "method_config", "run", "run_question",
           "save", "summarize", "unavailable"]
