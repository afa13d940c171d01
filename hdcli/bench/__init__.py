"""Benchmarks users can re-run: Spec-Bench with hd's methods and the peers, in one process.

    specbench.py   the question set: find, load, select by category
    runner.py      methods (hd's and the peers'), interleaved runs, the summary and saved answers
"""
from .runner import (DEFAULT_METHODS, METHOD_HELP, METHODS, HfGenerate, Runner, Turn, check_methods,
                     machine, make_runners, run, run_question, save, summarize)

__all__ = ["DEFAULT_METHODS", "METHOD_HELP", "METHODS", "HfGenerate", "Runner", "Turn", "check_methods",
           "machine", "make_runners", "run", "run_question", "save", "summarize"]
