"""Models a user already has, found by the names their other tools give them.

Two local stores are read; neither is ever written:

  * **Ollama** (`--model ollama:NAME[:TAG]`): its folder is `$OLLAMA_MODELS`, else
    `~/.ollama/models`. A name `[REGISTRY/][NAMESPACE/]NAME[:TAG]` (defaults registry.ollama.ai,
    library, latest) has its manifest at `manifests/REGISTRY/NAMESPACE/NAME/TAG`: JSON whose
    `layers` hold one of media type `application/vnd.ollama.image.model`, whose digest
    `sha256:HEX` names the GGUF blob `blobs/sha256-HEX`.
  * **LM Studio** (`--model lmstudio:PUBLISHER/NAME[/FILE.gguf]`, or `lmstudio:FILE[.gguf]` for a
    file name found once): its folders are `$LMSTUDIO_MODELS` (hd's own override), else
    `~/.lmstudio/models` and `~/.cache/lm-studio/models`, laid out `PUBLISHER/NAME/FILE.gguf`.
    A model folder with several quantizations needs the file named; `mmproj*` files (vision
    projectors) are never a model.

`list_models()` reads every GGUF either store holds (`hd models`): name, path, architecture,
quantization mix, size, and whether hd owns its forward (engine/model: exact, M-invariant) or runs
it on transformers' forward.

Invariant: a name resolves to one existing GGUF file inside its store (its parts are file names,
checked before any is looked up: never '..', a root or longer than a file name can be) or raises
HdError in one line naming where hd looked and what to do; a blob that is not a GGUF, or a
projector named as a model, is refused here, before any load. `hd models` lists every entry it
can and says each one it cannot in one line.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import inputs
from . import environment
from ..errors import HdError

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
PREFIXES = ("ollama:", "lmstudio:")


def ollama_root() -> Path:
    return Path(environment.ollama_models() or Path.home() / ".ollama" / "models").expanduser()


def lmstudio_roots() -> list[Path]:
    if environment.lmstudio_models():
        return [Path(environment.lmstudio_models()).expanduser()]
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def _present_lmstudio_roots() -> list[Path]:
    """lmstudio_roots() that exist, each folder once (one linked under both names is read once)."""
    return list({r.resolve(): r for r in lmstudio_roots() if r.is_dir()}.values())


def is_store_name(name: str) -> bool:
    return name.startswith(PREFIXES)


def resolve(name: str) -> Path:
    """The GGUF file an `ollama:` or `lmstudio:` name stands for."""
    store, _, rest = name.partition(":")
    if not rest.strip():
        raise HdError(f"--model {name}: give a model name after '{store}:' (`hd models` lists what is there)")
    return _ollama(rest.strip()) if store == "ollama" else _lmstudio(rest.strip())


def _check_gguf(path: Path, what: str) -> Path:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise HdError(f"{what}: cannot read {path} ({exc.strerror}); check its permissions") from None
    if magic != b"GGUF":
        raise HdError(f"{what}: {path} is not a GGUF file (it may be a projector, adapter or a partial "
                      "download); pull the model again or pass a .gguf file")
    return path


# Ollama's own rules for a name's parts (its types/model/name.go): letters, digits, '_', '-', '.',
# starting with a letter or digit ('_' too for a tag), 80 characters at most (a registry: a host
# name, ':' for its port too, and here at most a file name's 255). So a part is one file name
# inside the store: never '..', never a path, never too long for the file system.
_OLLAMA_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,79}")
_OLLAMA_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")
_OLLAMA_REGISTRY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,254}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
NAME_MAX = 255              # bytes of one file name (Linux, macOS); longer: ENAMETOOLONG
MANIFEST_BYTES = 1 << 20    # an Ollama manifest lists a few layers in about 1 KB


def _ollama_parts(spec: str) -> tuple[str, str, str, str]:
    """(registry, namespace, name, tag) of `[REGISTRY/][NAMESPACE/]NAME[:TAG]`."""
    path, tag = spec, OLLAMA_TAG
    if ":" in spec.rsplit("/", 1)[-1]:
        path, tag = spec.rsplit(":", 1)
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 3 or not tag:
        raise HdError(f"--model ollama:{_short(spec)}: expected ollama:NAME[:TAG], e.g. ollama:llama3.2:3b")
    if len(parts) == 1:
        parts = [OLLAMA_REGISTRY, OLLAMA_NAMESPACE] + parts
    elif len(parts) == 2:
        parts = [OLLAMA_REGISTRY] + parts
    checks = zip(parts + [tag], (_OLLAMA_REGISTRY, _OLLAMA_PART, _OLLAMA_PART, _OLLAMA_TAG),
                 ("registry", "namespace", "name", "tag"))
    for part, rule, what in checks:
        if not rule.fullmatch(part):
            raise HdError(f"--model ollama:{_short(spec)}: its {what} {_short(part)!r} is not an Ollama name "
                          "(letters, digits, '_', '-', '.'; 80 characters at most); see `hd models`")
    return parts[0], parts[1], parts[2], tag


def _short(text: str, most: int = 60) -> str:
    """A name as an error line shows it: a 5,000-character one cut to its start."""
    return text if len(text) <= most else text[:most] + f"... ({len(text)} characters)"


def _ollama(spec: str) -> Path:
    root = ollama_root()
    registry, namespace, model, tag = _ollama_parts(spec)
    manifest = root / "manifests" / registry / namespace / model / tag
    if not manifest.is_file():
        where = "$OLLAMA_MODELS" if environment.ollama_models() else "the default folder (set $OLLAMA_MODELS to move it)"
        raise HdError(f"ollama model {spec} not found: no manifest {manifest} (looked in {where}); "
                      "`ollama pull` it, or see `hd models`")
    text = inputs.read_text(manifest, "ollama manifest", MANIFEST_BYTES, "the store is damaged; `ollama pull` the model again")
    try:
        doc = json.loads(text)
    except ValueError:
        raise HdError(f"ollama manifest {manifest} is not JSON: the store is damaged; `ollama pull` the model again") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    digests = [l.get("digest") for l in layers if isinstance(l, dict) and l.get("mediaType") == OLLAMA_MODEL_LAYER] \
        if isinstance(layers, list) else []
    if not digests:
        raise HdError(f"ollama manifest {manifest} names no layer of media type {OLLAMA_MODEL_LAYER}: "
                      "not a model hd can run, or the store is damaged")
    digest = digests[0]
    algo, _, hexdigest = str(digest).partition(":")
    if algo != "sha256" or not _SHA256_HEX.fullmatch(hexdigest):   # a blob's name: never a path, never too long
        raise HdError(f"ollama manifest {manifest}: model layer digest {_short(repr(digest))} is not "
                      "sha256:<64 hex digits>; the store is damaged")
    blob = root / "blobs" / f"sha256-{hexdigest}"
    if not blob.is_file():
        raise HdError(f"ollama manifest {manifest} points at blob {blob}, which is missing: "
                      "`ollama pull` the model again")
    return _check_gguf(blob, f"ollama model {spec}")


def _is_projector(p: Path) -> bool:
    return p.name.lower().startswith("mmproj")


def _is_model_file(p: Path) -> bool:
    return p.suffix == ".gguf" and p.is_file() and not _is_projector(p)


def _lmstudio_parts(spec: str) -> tuple[str, ...]:
    """The file names of `PUBLISHER/NAME[/FILE.gguf]` or `FILE[.gguf]`: each a name inside the
    store (never '..', '.', a root or empty), and short enough for the file system."""
    parts = tuple(spec.split("/"))
    if spec.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise HdError(f"--model lmstudio:{_short(spec)}: expected a name inside the store, "
                      "lmstudio:PUBLISHER/NAME[/FILE.gguf] or lmstudio:FILE; see `hd models`")
    long = next((p for p in parts if len(p.encode("utf-8", "replace")) > NAME_MAX), None)
    if long is not None or len(parts) > 8:
        raise HdError(f"--model lmstudio:{_short(spec)}: " + (f"{_short(long)!r} is longer than a file name "
                      f"can be ({NAME_MAX} bytes)" if long is not None else "too many folders") + "; see `hd models`")
    return parts


def _lmstudio(spec: str) -> Path:
    parts = _lmstudio_parts(spec)
    roots = _present_lmstudio_roots()
    looked = ", ".join(str(r) for r in lmstudio_roots())
    for root in roots:
        target = root.joinpath(*parts)
        if target.is_file() and target.suffix == ".gguf":
            if _is_projector(target):
                raise HdError(f"lmstudio model {spec}: {target.name} is a vision projector (mmproj), not a "
                              "model: name the model's own .gguf (`hd models` lists them)")
            return _check_gguf(target, f"lmstudio model {spec}")
        if target.is_dir() and spec.count("/") >= 1:
            files = sorted(p for p in target.iterdir() if _is_model_file(p))
            if len(files) == 1:
                return _check_gguf(files[0], f"lmstudio model {spec}")
            if len(files) > 1:
                raise HdError(f"lmstudio model {spec} holds {len(files)} GGUF files "
                              f"({', '.join(p.name for p in files)}): name one, e.g. lmstudio:{spec}/{files[0].name}")
    # a file name (with or without .gguf) anywhere in the stores
    want = parts[:-1] + (parts[-1] if parts[-1].endswith(".gguf") else parts[-1] + ".gguf",)
    # matched by name, not as a glob pattern: '*' or '[' in a name is a character of it
    found = sorted(p for root in roots for p in root.rglob("*.gguf")
                   if p.relative_to(root).parts[-len(want):] == want and _is_model_file(p))
    if len(found) == 1:
        return _check_gguf(found[0], f"lmstudio model {spec}")
    if len(found) > 1:
        raise HdError(f"lmstudio model {spec} matches {len(found)} files ({', '.join(str(p) for p in found)}): "
                      "name it as lmstudio:PUBLISHER/NAME/FILE.gguf")
    raise HdError(f"lmstudio model {spec} not found under {looked} (set $LMSTUDIO_MODELS for another "
                  "folder); see `hd models`")


@dataclass
class LocalModel:
    name: str                  # what --model takes
    path: str
    size_bytes: int
    architecture: str | None   # general.architecture; None where the file could not be read
    quants: dict               # tensor type -> tensors of that type
    forward: str               # "hd" (exact, M-invariant), "transformers" or "unreadable: why"

    def to_dict(self) -> dict:
        return asdict(self)


def _describe(name: str, path: Path) -> LocalModel:
    from .model import family_of
    from .model.gguf import GGUFFile
    size = path.stat().st_size
    try:
        gf = GGUFFile(path)
    except HdError as exc:
        return LocalModel(name, str(path), size, None, {}, f"unreadable: {exc}")
    try:
        quants = gf.type_counts()
        owned = family_of(gf.arch) is not None
        return LocalModel(name, str(path), size, gf.arch, quants, "hd" if owned else "transformers")
    finally:
        gf.release()


def _ollama_entries(skipped: list[dict]) -> list[tuple[str, Path]]:
    """(name, blob) of each model manifest; a manifest that names no runnable blob goes to
    skipped as {"name", "problem"} (the line `hd generate` would say), and the rest are listed."""
    root = ollama_root()
    out = []
    base = root / "manifests"
    if not base.is_dir():
        return out
    for manifest in sorted(p for p in base.rglob("*") if p.is_file()):
        parts = manifest.relative_to(base).parts
        if len(parts) != 4:
            continue
        registry, namespace, model, tag = parts
        if registry != OLLAMA_REGISTRY:
            name = f"{registry}/{namespace}/{model}:{tag}"
        else:
            name = f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"
        try:
            out.append((f"ollama:{name}", _ollama(name)))
        except HdError as exc:
            skipped.append({"name": f"ollama:{name}", "problem": str(exc)})
    return out


def _lmstudio_entries() -> list[tuple[str, Path]]:
    out = []
    for root in _present_lmstudio_roots():
        for p in sorted(root.rglob("*.gguf")):
            if _is_model_file(p):
                out.append((f"lmstudio:{p.relative_to(root).as_posix()}", p))
    return out


def list_models() -> tuple[list[LocalModel], list[dict]]:
    """Every GGUF model the local stores hold, described (each file's header read once), and the
    entries skipped, each with its problem in one line."""
    skipped: list[dict] = []
    found = _ollama_entries(skipped) + _lmstudio_entries()
    return [_describe(name, path) for name, path in found], skipped


def searched() -> dict:
    """Where list_models looked."""
    return {"ollama": str(ollama_root()), "lmstudio": [str(r) for r in lmstudio_roots()]}


def store_warnings() -> list[str]:
    """A line for each store folder that is there but cannot be listed (a file, or a folder hd may
    not read): listing finds nothing in it, which said nothing (OLLAMA_MODELS=/etc/passwd listed
    no models). A default folder that is absent is no store, and says nothing."""
    roots = [("$OLLAMA_MODELS" if environment.ollama_models() else "Ollama's default folder", ollama_root())]
    roots += [("$LMSTUDIO_MODELS" if environment.lmstudio_models() else "LM Studio's default folder", r)
              for r in lmstudio_roots()]
    out = []
    for what, root in roots:
        if not os.path.lexists(root):
            continue
        if not root.is_dir():
            out.append(f"warning: {what} {root} is not a folder: no models are listed from it; point it at "
                       "the store's folder")
        elif not os.access(root, os.R_OK | os.X_OK):
            out.append(f"warning: {what} {root} cannot be read (permission denied): no models are listed from "
                       "it; make it readable, or point it at another folder")
    return out


def report() -> dict:
    """What `hd models` shows: every GGUF in the stores, where hd looked, the entries skipped
    (each with its problem) and a warning for each store that is there but cannot be listed."""
    found, skipped = list_models()
    return {"searched": searched(), "models": [m.to_dict() for m in found], "skipped": skipped,
            "warnings": store_warnings()}
