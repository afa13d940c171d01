"""Conformance of round six (docs/reliability.md, "Round six"): an interrupt at any moment of a
start ends hd in one line with 128 + the signal and leaves nothing running or locked; a cap or an
adjustment is said on stderr and in the output; a non-finite number is refused naming its field;
a model store that is no folder is said. The signals reach real `hd` processes (the console
script's entry, hdcli/__main__.py), sent at points chosen by what the process has reached (an
import begun, a function called, a line written), never by a clock; the served cases go through
the `openai` client, as round five's (tests/test_serve_clients.py)."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from hdcli import interrupts
from hdcli.engine.kernels import build

from conftest import PATIENCE, require_bundled

# A real start of `hd ARGS` (argv after the point) that signals itself at POINT, then runs hd's
# console entry. POINT is MODULE (as its import begins) or MODULE:ATTR[@N] (after the Nth call of
# the attribute, N 1 by default). The handler runs at the next check of the main thread: at once as
# a rule, but a loaded machine may be late, so the caller waits there for it.
AT = """
import importlib.abc, importlib.util, os, signal, sys, time
point, sig = sys.argv[1], getattr(signal, sys.argv[2])
sys.argv = ["hd"] + sys.argv[3:]
module, _, attr = point.partition(":")
attr, _, nth = attr.partition("@")

def fire():
    os.kill(os.getpid(), sig)
    for _ in range(6000):
        time.sleep(0.01)

class At(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != module:
            return None
        sys.meta_path.remove(self)
        if not attr:
            fire()
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(mod):
            run(mod)
            *where, last = attr.split(".")
            owner = mod
            for part in where:
                owner = getattr(owner, part)
            real, calls = getattr(owner, last), []
            def hook(*a, **kw):
                out = real(*a, **kw)
                calls.append(1)
                if len(calls) == int(nth or 1):
                    fire()
                return out
            setattr(owner, last, hook)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, At())
from hdcli.__main__ import main
main()
"""

# A first build of the kernels (an empty TORCH_EXTENSIONS_DIR), torch's compile replaced by what it
# does as the signal comes: torch's `lock` made, a compiler process with one of its own (ninja and
# c++), a file in $RUNNING once both run (a file, not a line: a line on the pipe of stderr was
# sometimes not read while the build waited), and a wait for them.
BUILDING = """
import importlib.abc, importlib.util, os, subprocess, sys
sys.argv = ["hd"] + sys.argv[1:]
COMPILER = ("import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            "open(os.path.join(os.environ['RUNNING'], str(os.getpid())), 'w').close(); time.sleep(600)")

def load(name, sources, **kw):
    from torch.utils import cpp_extension
    folder = cpp_extension._get_build_directory(name, False)
    open(os.path.join(folder, "lock"), "x").close()
    subprocess.run([sys.executable, "-c", COMPILER])

class At(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.utils.cpp_extension":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(mod):
            run(mod)
            mod.load = load
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, At())
from hdcli.__main__ import main
main()
"""

# A process holding an extension's build lock (as a build does, torch's lock made under it) until
# its stdin closes; it says so first.
HOLDER = """
import sys
from pathlib import Path
from hdcli.engine.kernels import build
folder = Path(sys.argv[1])
with build.build_lock(folder, "the test kernel"):
    (folder / build.TORCH_LOCK_NAME).write_bytes(b"")
    print("held", flush=True)
    sys.stdin.read()
"""

GENERATE = ["generate", "-p", "Write a long story about a cat.", "-n", "48"]


def _default_signals():
    # a test run in the background of a shell without job control inherits SIGINT ignored, and hd
    # keeps a signal ignored at its start: the processes here start as a terminal's would
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(argv, env=None, **kw) -> subprocess.Popen:
    """A process in a session of its own (its group is what it leaves running)."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_signals,
                            env={**os.environ, **(env or {})}, **kw)


def left_running(group: int) -> list[str]:
    """What still runs in a process group: (pid, command) of each process that is not a zombie."""
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        state, _, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]
        if int(pgrp) == group and state not in (b"Z", b"X"):
            out.append(f"{name} {stat[stat.index(b'(') + 1:stat.rindex(b')')].decode()}")
    return out


def ended_by(p: subprocess.Popen, sig: int, stdin: str | None = None) -> tuple[str, str]:
    """The process ended as a signal must end it: 128 + sig, its last stderr line the one line
    for it (and no other), no traceback, nothing of its group left running. Returns (stdout, stderr)."""
    out, err = p.communicate(stdin, timeout=PATIENCE)
    what = "interrupted" if sig == signal.SIGINT else "terminated"
    lines = err.strip().splitlines()
    assert p.returncode == 128 + sig, (p.returncode, err[-3000:])
    assert lines[-1] == f"error: {what} ({signal.Signals(sig).name})", err[-3000:]
    assert "Traceback" not in err and sum("error:" in line for line in lines) == 1, err[-3000:]
    assert left_running(p.pid) == [], left_running(p.pid)
    return out, err


@pytest.mark.parametrize("point,sig", [
    ("numpy._core.multiarray", signal.SIGINT),             # an import during the CLI's: was swallowed
    ("torch", signal.SIGTERM),                              # torch's import: was a traceback
    ("hdcli.engine.model.gguf:np.memmap", signal.SIGINT),   # the GGUF just mapped
    ("hdcli.engine.text.prompts:TextStream.__call__@3", signal.SIGINT),   # mid-answer
    ("hdcli.cli:_finish_layout_cache", signal.SIGTERM),     # the answer written: the last step
])
def test_a_signal_at_any_point_of_a_start_ends_hd_in_one_line(point, sig):
    """SIGINT at 0.2-4 s into a start printed a traceback (torch's and numpy's imports), died by
    the signal (rc -2), or was swallowed by an import and the answer ran on to exit 0."""
    require_bundled()
    out, err = ended_by(start([sys.executable, "-c", AT, point, signal.Signals(sig).name, *GENERATE]), sig)
    if "TextStream" in point:
        assert out.strip(), "the answer's first pieces were printed before the signal"
    if "finish_layout" in point:
        assert out.strip(), "the whole answer was printed before the signal"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_kernel_build_stops_the_compiler_and_frees_both_locks(tmp_path, sig):
    """A signal while the GGUF GEMM compiled (and the fused attention beside it, on a thread):
    the compiler went on, re-parented to init, and its `lock` stayed: the next starts waited for
    it for minutes. Now the compilers are killed, torch's lock is removed and hd's left empty."""
    require_bundled()
    running = tmp_path / "running"
    running.mkdir()
    p = start([sys.executable, "-c", BUILDING, *GENERATE],
              env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "RUNNING": str(running)})
    deadline = time.monotonic() + PATIENCE
    while not any(running.iterdir()):   # the build began: a compiler runs
        assert p.poll() is None and time.monotonic() < deadline, f"no build began: exit {p.poll()}"
        time.sleep(0.05)
    p.send_signal(sig)
    ended_by(p, sig)
    folders = [f for f in (tmp_path / "ext").iterdir() if f.is_dir()]
    assert folders
    for folder in folders:
        assert not (folder / build.TORCH_LOCK_NAME).exists(), folder
        assert (folder / build.LOCK_NAME).read_text() == "", folder


def test_a_signal_when_the_model_is_loading_ends_hd_in_one_line():
    """As a user sends it: SIGTERM once the model's loading line is out (whatever hd is doing by
    the time it arrives, the end is the same)."""
    require_bundled()
    p = start([sys.executable, "-m", "hdcli", *GENERATE])
    for line in p.stderr:
        if line.startswith("loading "):
            break
    p.send_signal(signal.SIGTERM)
    ended_by(p, signal.SIGTERM)


def test_a_build_lock_whose_holder_was_killed_is_taken_at_once_and_said(tmp_path, monkeypatch, capsys):
    """A build killed by SIGKILL leaves torch's lock and hd's record of it: the next start takes
    the lock at once (the holder's flock died with it), says so in one line naming the PID, and
    removes torch's lock; it never waits."""
    from torch.utils import cpp_extension
    from hdcli.engine.kernels import fused
    folder = tmp_path / "hd_k"
    holder = start([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(folder))
    monkeypatch.setattr(cpp_extension, "load", lambda name, **kw: "module")
    assert build.compile_extension(fused.SOURCE, "hd_k", "the test kernel", quiet=True) == ("module", None)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"was left by PID {holder.pid} " in err[0] and "which is gone" in err[0], err
    assert f"removing {folder / build.TORCH_LOCK_NAME}" in err[0], err
    assert not (folder / build.TORCH_LOCK_NAME).exists() and (folder / build.LOCK_NAME).read_text() == ""


def test_a_build_lock_held_by_a_live_process_is_waited_for_naming_it(tmp_path):
    """A live holder is waited for (no age makes its lock stale), the waiter saying whom for."""
    folder = tmp_path / "hd_w"
    holder = start([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "held"
    waiter = start([sys.executable, "-c", "import sys\nfrom pathlib import Path\nfrom hdcli.engine.kernels import build\n"
                    "with build.build_lock(Path(sys.argv[1]), 'the test kernel'):\n    print('got it', flush=True)",
                    str(folder)])
    said = waiter.stderr.readline()
    assert f"hd: waiting for PID {holder.pid} (since " in said and "building the test kernel" in said, said
    holder.communicate("")            # the holder lets go (its build ended)
    out, err = waiter.communicate(timeout=PATIENCE)
    assert waiter.returncode == 0 and out.strip() == "got it" and err == "", err


def test_no_build_begins_in_a_process_that_is_ending(tmp_path, monkeypatch):
    """A thread that reaches a build after the signal (the fused attention's, beside the GEMM's)
    starts no compiler: the process is ending."""
    from torch.utils import cpp_extension
    from hdcli.engine.kernels import fused
    calls = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    monkeypatch.setattr(cpp_extension, "load", lambda name, **kw: calls.append(name))
    monkeypatch.setattr(interrupts, "_received", signal.SIGINT)
    assert build.compile_extension(fused.SOURCE, "hd_e", "the test kernel", quiet=True)[0] is None
    monkeypatch.setattr(interrupts, "_received", None)    # the control: not ending, it builds
    build.compile_extension(fused.SOURCE, "hd_e", "the test kernel", quiet=True)
    assert calls == ["hd_e"]


# --- item 2: every cap said on stderr and in the output ------------------------------------------

def _cli(*args, env=None):
    """`hd ARGS` through typer's runner: (exit code, stdout, stderr); an HdError as the console's exit 2."""
    from typer.testing import CliRunner
    from hdcli import cli
    from hdcli.errors import HdError
    try:
        r = CliRunner().invoke(cli.app, list(args), catch_exceptions=False, env=env)
    except HdError as exc:
        return 2, "", f"error: {exc}"
    return r.exit_code, r.stdout, r.stderr


def test_a_capped_answer_says_so_on_stderr_and_in_its_json(tiny_model_dir):
    """An 8,151-token prompt and --max-new-tokens 48 gave 41 tokens under --json with no word of the
    cap: the warning went only to a status line that --json turns off."""
    prompt = " ".join(["the cat sat on the mat"] * 35)   # ~210 of the tiny model's 256 positions
    code, out, err = _cli("generate", "--model", str(tiny_model_dir), "-p", prompt, "-n", "48", "--json")
    assert code == 0, err
    data = json.loads(out)
    said = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(said) == 1 and "--max-new-tokens 48 exceeds the room left" in said[0], err
    assert data["warnings"] == said and len(data["tokens"]) < 48, data["warnings"]
    # the control: an answer that fits has none, on either side
    code, out, err = _cli("generate", "--model", str(tiny_model_dir), "-p", "the cat", "-n", "8", "--json")
    assert code == 0 and json.loads(out)["warnings"] == [] and "warning" not in err, err


@pytest.fixture(scope="module")
def served(serve_model_dir):
    """The tiny model served with a default of 250 new tokens: more than a long prompt leaves."""
    from hdcli import api
    from test_serve import Running
    r = Running(api.DecodingConfig(model=str(serve_model_dir), dtype="fp32", kernels="torch", max_new_tokens=250),
                max_batch=4)
    yield r
    r.stop()


LONG = " ".join(["the dog ran up the hill and then it was a good day"] * 8)   # ~100 tokens of 256


def test_a_served_answer_capped_by_the_servers_default_says_so_in_its_body(served):
    """max_tokens unset: the server's default (250) was cut to the room left in silence."""
    c = served.client()
    r = c.completions.create(model=served.server.name, prompt=LONG, temperature=0)
    warned = (r.model_extra or {}).get("warnings")
    assert warned and "max_tokens: unset, and the server's default of 250 new tokens exceeds" in warned[0], warned
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 256
    chunks = list(c.completions.create(model=served.server.name, prompt=LONG, temperature=0, stream=True))
    first = [(ch.model_extra or {}).get("warnings") for ch in chunks]
    assert first[0] == warned and not any(first[1:]), first[:3]    # said once, in the first chunk
    # the controls: a request that asks for what fits, and a short prompt, have none
    r = c.completions.create(model=served.server.name, prompt=LONG, temperature=0, max_tokens=5)
    assert "warnings" not in (r.model_extra or {})
    r = c.completions.create(model=served.server.name, prompt="the cat", temperature=0, max_tokens=5)
    assert "warnings" not in (r.model_extra or {})


def test_a_served_field_taken_and_not_acted_on_is_in_the_body_and_the_header(served):
    c = served.client()
    raw = c.chat.completions.with_raw_response.create(
        model=served.server.name, messages=[{"role": "user", "content": "the cat"}], max_tokens=4,
        temperature=0, reasoning_effort="low")
    body = raw.parse()
    assert raw.headers.get("x-hd-ignored-fields") == "reasoning_effort"
    assert body.model_extra["warnings"] == ["reasoning_effort: taken and not acted on (hd serve does not implement it)"]


# --- item 3: NaN and Infinity refused as not finite, naming the field ----------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", "NaN"), ("top_p", "NaN"), ("frequency_penalty", "Infinity"),
    ("presence_penalty", "-Infinity"), ("logit_bias", '{"5": NaN}'),
])
def test_a_served_non_finite_number_is_refused_naming_its_field(served, field, value):
    """`"temperature": NaN` got 400 "temperature: Input should be less than or equal to 2"."""
    from test_serve import http
    body = ('{"model": "%s", "prompt": "the cat", "max_tokens": 2, "%s": %s}'
            % (served.server.name, field, value)).encode()
    status, text = http("POST", served.url + "/v1/completions", body)
    err = json.loads(text)["error"]
    assert status == 400 and err["param"].split(".")[0] == field, text
    assert err["message"].startswith(field) and "finite number" in err["message"], text
    # the control: the same field at a finite value is taken
    fine = '{"5": 1.0}' if field == "logit_bias" else "0.5"
    status, text = http("POST", served.url + "/v1/completions", body.replace(value.encode(), fine.encode()))
    assert status == 200, text


@pytest.mark.parametrize("args,named", [
    (["--temperature", "nan"], "--temperature"), (["--top-p", "inf"], "--top-p"),
    (["--presence-penalty", "-inf"], "--presence-penalty"), (["--logit-bias", "5=nan"], "--logit-bias"),
    (["--stats-min-prob", "nan"], "--stats-min-prob"),
])
def test_a_non_finite_option_is_refused_naming_it(tiny_model_dir, args, named):
    code, _, err = _cli("generate", "--model", str(tiny_model_dir), "-p", "the cat", "-n", "2", *args)
    assert code == 2 and named in err and "finite number" in err and len(err.strip().splitlines()) == 1, err


def test_a_non_finite_number_in_a_config_file_is_refused_naming_its_field(tiny_model_dir, tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"temperature": NaN}')
    code, _, err = _cli("generate", "--model", str(tiny_model_dir), "-p", "the cat", "-n", "2", "--config", str(path))
    assert code == 2 and "'temperature' must be a finite number, not nan" in err, err
    path.write_text('{"temperature": 0.5}')   # the control
    code, _, err = _cli("generate", "--model", str(tiny_model_dir), "-p", "the cat", "-n", "2", "--config", str(path),
                        "--seed", "1")
    assert code == 0, err


def test_a_non_finite_sampling_field_of_the_api_is_refused_naming_it():
    from hdcli.engine.decode.verify import Sampling
    for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        with pytest.raises(ValueError, match=f"^{name} must be a finite number, not nan$"):
            Sampling(**{name: math.nan})
    with pytest.raises(ValueError, match="bias of token 5 must be a finite number"):
        Sampling(logit_bias=((5, math.inf),))
    Sampling(temperature=0.5, logit_bias=((5, 1.0),))   # the control


# --- item 4: a model store that cannot be listed is said -----------------------------------------

@pytest.mark.parametrize("variable", ["OLLAMA_MODELS", "LMSTUDIO_MODELS"])
def test_a_model_store_that_is_a_file_is_said_in_text_and_json(tmp_path, variable):
    """OLLAMA_MODELS=/etc/passwd listed no models, rc 0, without a word."""
    store = tmp_path / "not-a-folder"
    store.write_text("root:x:0:0\n")
    env = {"HOME": str(tmp_path / "home"), "OLLAMA_MODELS": "", "LMSTUDIO_MODELS": "", variable: str(store)}
    code, out, err = _cli("models", "--json", env=env)
    data = json.loads(out)
    line = f"warning: ${variable} {store} is not a folder"
    assert code == 0 and len(data["warnings"]) == 1 and data["warnings"][0].startswith(line), data
    assert [ln for ln in err.splitlines() if ln.startswith("warning:")] == data["warnings"], err
    code, out, err = _cli("models", env=env)
    assert code == 0 and line in " ".join(err.split()), err
    store.unlink()
    store.mkdir()   # the control: a folder, empty, is a store with no models
    code, out, err = _cli("models", "--json", env=env)
    assert json.loads(out)["warnings"] == [] and "warning" not in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder: no permission to take away")
def test_a_model_store_that_cannot_be_read_is_said(tmp_path):
    store = tmp_path / "locked"
    store.mkdir()
    store.chmod(0)
    try:
        code, out, _ = _cli("models", "--json", env={"HOME": str(tmp_path), "LMSTUDIO_MODELS": "",
                                                     "OLLAMA_MODELS": str(store)})
        assert "cannot be read" in json.loads(out)["warnings"][0]
    finally:
        store.chmod(0o755)


# A process whose main thread waits on a child (as a build waits on its compiler) while the signal
# is given to another of its threads, as the kernel may give it: $1 "relay" or "no-relay".
OTHER_THREAD = """
import signal, subprocess, sys, threading
from hdcli import interrupts
if sys.argv[1] == "no-relay":
    interrupts._relay_signals = lambda: None
interrupts.install()
def give():
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
threading.Timer(0.5, give).start()
subprocess.run([sys.executable, "-c", "import time; time.sleep(600)"])
"""


def test_a_signal_given_to_another_thread_ends_hd_while_its_main_thread_waits():
    """The kernel gives a process's signal to any thread; Python runs the handler on the main
    thread only, when it next runs bytecode: a main thread waiting on a compiler heard a signal
    taken by another thread only when the compiler ended (a 10-minute stall in a test)."""
    ended_by(start([sys.executable, "-c", OTHER_THREAD, "relay"]), signal.SIGINT)
    # the control: without the relay the process waits on its child, deaf to the signal
    p = start([sys.executable, "-c", OTHER_THREAD, "no-relay"])
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(5)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
