"""`hd bench agents`: the outputs agents ask for, each method under the same constraint, interleaved.

Workloads (--workloads; categories are what the tables break figures down by):
  tools   BFCL function calling (../shared/data/bfcl, Apache-2.0, read SOURCE.md): simple_python,
          multiple and parallel questions, each under tool_choice `auto` and `required`. The tools
          are rendered into the prompt by the model's own template, or for one without tool support
          (the bundled SmolLM2) in hd's system message (engine/text/tools.py). `required` is constrained
          by the grammar of the calls the tools allow (parallel_tool_calls true for the parallel
          subset only, where one answer holds several calls); `auto` is not constrained (a call is
          parsed from the text, as hd serve does). Categories: tools/<subset>/<choice>.
  json    JSON-schema output: the parameters of BFCL simple_python functions (prompt: the question,
          asking for the call's arguments as JSON) and four schemas written here (contact, event,
          review, recipe; prompt: a text to extract from or a request), constrained by the schema.
          Categories: json/bfcl, json/own.
  edits   instructions written here (add type hints, add docstrings, rename a variable, fix a bug
          described in words) over Python functions of 10-40 lines from ../shared/corpora
          (codealpaca_2k, CC BY-NC 4.0; gpteacher_codegen, MIT), the file as it is sent being the
          prediction (for the bug, the file with the bug put in). No grammar. Categories: edits/<kind>.

Methods: ar (plain decoding under the item's grammar: the baseline), hd (the default hierarchy,
the grammar layer and, for edits, the prediction layer), suffix (SuffixDecoding's drafts under the
same grammar: forbidden drafts are cut before the forward; it gets no prediction, it has no such
input) and llama-cpp (llama.cpp on the same GGUF with its own grammar: the JSON schema, or for
tool_choice required the call wrapped in <tool_call> as GBNF from the same schema; without a
grammar where ar has none; no prediction).

Figures are runner.summarize's (tok/s, speedup over ar, mean accepted tokens, each layer's share,
answers unlike ar's) per workload and category, with `valid`: the share of answers that parse and
validate (JSON: parses and follows the schema, checked by `problem` below, not by the grammar
engine; tools: well-formed calls of offered tools whose arguments follow the tool's schema;
`auto` answers that are plain text count apart, as `text`; edits: the reply's code block parses
as Python).
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import inputs
from ..errors import HdError
from . import runner
from ..engine.text import tools
from ..engine.text import constrain
from ..engine.decode.prediction import prediction_ids
from ..engine.text.prompts import encode_messages
from ..drafting import suffix
from . import llamacpp
from ..compose import warm_up
from ..engine.text.prompts import encode_prompt
from .report import layer_table
from .llamacpp import LlamaCppModel

WORKLOADS = ("tools", "json", "edits")
METHODS = ("ar", "hd", "suffix", "llama-cpp")
METHOD_HELP = {
    "ar": "plain decoding under the item's grammar (the baseline)",
    "hd": "the default hierarchy with the grammar layer, and for edits the prediction layer",
    "suffix": "SuffixDecoding drafts, verified by hd under the same grammar (no prediction)",
    "llama-cpp": "llama.cpp (llama-cpp-python, optional) on the same GGUF with its own JSON-schema grammar",
}
BFCL_SUBSETS = ("simple_python", "multiple", "parallel")
TOOL_CHOICES = ("auto", "required")
EDIT_KINDS = ("type_hints", "docstring", "rename", "fix_bug")
MAX_NEW_TOKENS = {"tools": 160, "json": 192, "edits": 512}
BFCL_WHERE = ("BFCL's data folder (berkeley-function-call-leaderboard/bfcl_eval/data of "
              "https://github.com/ShishirPatil/gorilla)")
CORPORA_WHERE = "the folder of codealpaca_2k.jsonl and gpteacher_codegen.jsonl"


@dataclass
class Item:
    """One question of a workload: its messages and what constrains and checks its answer."""
    question_id: str
    category: str                    # workload/... (the tables' rows)
    messages: list[dict]
    tools: list | None = None        # engine.text.tools.Tool list (tools workload)
    tool_choice: str | None = None   # auto | required
    parallel: bool = False
    schema: dict | None = None       # json workload
    prediction: str | None = None    # edits workload
    max_new_tokens: int = 256
    extra: dict = field(default_factory=dict)

    @property
    def workload(self) -> str:
        return self.category.split("/")[0]

    def record(self) -> dict:
        """The question as runner.summarize and answer records take it."""
        return {"question_id": self.question_id, "category": self.category, "subcategory": self.category}


# ---------------------------------------------------------------- data

def find_folder(given: str | Path | None, flag: str, relative: str, marker: str, where: str) -> Path:
    """--bfcl / --corpora, else `relative` under the working folder's parent or the repository's."""
    if given is not None:
        p = Path(given)
        if not (p / marker).is_file():
            raise HdError(f"{flag} {p}: no {marker} there; pass {where}")
        return p
    for root in (Path.cwd() / "..", Path.cwd(), Path(__file__).resolve().parents[3]):
        if (root / relative / marker).is_file():
            return (root / relative).resolve()
    raise HdError(f"no {relative}/{marker} here or in the parent folder: pass {flag} with {where}")


def _json_lines(path: Path) -> list[dict]:
    text = inputs.read_text(path, "benchmark file", inputs.BENCH_BYTES, "pass a smaller data folder")
    out = []
    for n, line in enumerate(text.split("\n"), 1):   # not splitlines: U+2028 inside a string is text
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise HdError(f"{path}:{n}: not a JSON line") from None
    return out


def _first_value(options: list):
    """A BFCL accepted value: the first of its options that is not "" (BFCL's "may be left out");
    dicts' values are option lists themselves. None: leave the argument out."""
    for v in options:
        if v == "":
            continue
        if isinstance(v, dict):
            return {k: _first_value(o) for k, o in v.items() if _first_value(o) is not None}
        return v
    return None


def load_bfcl(folder: Path, subset: str) -> list[dict]:
    """{id, subset, messages, functions, answer}: a BFCL subset in file order; answer: the calls of
    the accepted answer ([{name, arguments}], each argument its first accepted value)."""
    qs = _json_lines(Path(folder) / f"BFCL_v4_{subset}.json")
    answers = {a["id"]: a["ground_truth"] for a in _json_lines(Path(folder) / "possible_answer" / f"BFCL_v4_{subset}.json")}
    out = []
    for q in qs:
        calls = []
        for call in answers.get(q["id"], []):
            for name, args in call.items():
                calls.append({"name": name, "arguments": {k: v for k, o in args.items()
                                                          if (v := _first_value(o)) is not None}})
        out.append({"id": q["id"], "subset": subset, "messages": q["question"][0], "functions": q["function"],
                    "answer": calls or None})
    return out


def bfcl_schema(parameters: dict) -> dict:
    """A BFCL function's parameters as JSON Schema (engine/text/tools.py's mapping)."""
    return tools.openai_tool_from_bfcl({"name": "f", "parameters": parameters})["function"]["parameters"]


def tools_items(folder: Path) -> list[Item]:
    out = []
    for subset in BFCL_SUBSETS:
        for q in load_bfcl(folder, subset):
            offered = tools.parse_tools([tools.openai_tool_from_bfcl(f) for f in q["functions"]])
            for choice in TOOL_CHOICES:
                out.append(Item(f"{q['id']}/{choice}", f"tools/{subset}/{choice}", q["messages"], tools=offered,
                                tool_choice=choice, parallel=subset == "parallel",
                                max_new_tokens=MAX_NEW_TOKENS["tools"]))
    return out


def json_prompt(request: str, schema: dict, what: str) -> str:
    return (f"{request}\n\nReply with only a JSON object ({what}) that follows this JSON Schema:\n"
            f"{json.dumps(schema)}")


def _obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


_S = {"type": "string", "maxLength": 80}
OWN_SCHEMAS = {
    "contact": _obj({"name": _S, "email": _S, "phone": _S, "company": _S}),
    "event": _obj({"title": _S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "city": _S,
                   "attendees": {"type": "array", "items": _S, "maxItems": 8}}),
    "review": _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                    "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": _S}),
    "recipe": _obj({"name": _S, "servings": {"type": "integer", "minimum": 1, "maximum": 20},
                    "ingredients": {"type": "array", "maxItems": 10, "items": _obj({"item": _S, "amount": _S})},
                    "steps": {"type": "array", "items": _S, "maxItems": 6}}),
}
OWN_REQUESTS = [
    ("contact", "Extract the contact details from this e-mail signature: 'Best regards, Maria Lopez, Head "
                "of Sales, Northwind Traders. maria.lopez@northwind.example, +1 415 555 0142'"),
    ("event", "Extract the event from this message: 'Hi all, the product launch party is on 12 March 2025 "
              "in Lisbon. Ana, Tom and Priya have confirmed.'"),
    ("review", "Classify this product review: 'The kettle boils fast and looks great, but the lid broke "
               "after two weeks. Disappointed.'"),
    ("recipe", "Give a simple recipe for pancakes."),
    ("contact", "Extract the contact details: 'Call me on 020 7946 0958 - John Smith, Acme Ltd, "
                "john@acme.example'"),
    ("event", "Extract the event: 'Our book club meets on 2024-11-05 in Berlin with Lena and Karl.'"),
    ("review", "Classify this review: 'Absolutely love this phone. Battery lasts two days.'"),
    ("recipe", "Give a recipe for a tomato salad for two people."),
]


def json_items(folder: Path) -> list[Item]:
    """BFCL simple_python functions' arguments and the schemas above, alternating."""
    bfcl = []
    for q in load_bfcl(folder, "simple_python"):
        fn = q["functions"][0]
        schema = bfcl_schema(fn["parameters"])
        text = json_prompt(q["messages"][-1]["content"], schema,
                           f"the arguments of {fn['name']}: {fn.get('description', '')}".rstrip(": "))
        bfcl.append(Item(f"{q['id']}/json", "json/bfcl", [{"role": "user", "content": text}], schema=schema,
                         max_new_tokens=MAX_NEW_TOKENS["json"]))
    own = [Item(f"own_{i}_{name}", "json/own",
                [{"role": "user", "content": json_prompt(request, OWN_SCHEMAS[name], name)}],
                schema=OWN_SCHEMAS[name], max_new_tokens=MAX_NEW_TOKENS["json"])
           for i, (name, request) in enumerate(OWN_REQUESTS)]
    return [x for pair in zip(bfcl, own) for x in pair] + bfcl[len(own):]


# ---------------------------------------------------------------- edits

CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
RENAMES = ("values", "data", "source", "items_in", "arg")
# (pattern, replacement, the bug in words): the first that applies to a snippet is put in
BUGS = (
    (r"\+= 1\b", "+= 2", "the counter on line {n} goes up by 2 each time; it must go up by 1"),
    (r" > ", " < ", "the comparison on line {n} is the wrong way round: it uses < where > is meant"),
    (r" < ", " > ", "the comparison on line {n} is the wrong way round: it uses > where < is meant"),
    (r"range\(len\((\w+)\)\)", r"range(len(\1) - 1)", "the loop on line {n} skips the last element"),
    (r" == ", " != ", "the test on line {n} is negated: it uses != where == is meant"),
)


def code_of(text: str) -> str:
    m = CODE_BLOCK.search(text)
    return m.group(1) if m else text


def parse_python(code: str):
    """ast of code, or None where it does not parse (the corpora's invalid escapes stay quiet)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ast.parse(code)
        except (SyntaxError, ValueError):
            return None


def _snippets(folder: Path) -> list[tuple[str, str]]:
    """(id, code): Python of 10-40 lines holding a function, from the two code corpora, alternating."""
    per_file = []
    for name in ("codealpaca_2k.jsonl", "gpteacher_codegen.jsonl"):
        got = []
        for r in _json_lines(folder / name):
            code = code_of(r.get("text", "")).strip("\n") + "\n"
            if not 10 <= code.count("\n") <= 40:
                continue
            tree = parse_python(code)
            if tree is not None and any(isinstance(x, ast.FunctionDef) and x.args.args for x in tree.body):
                got.append((r["id"], code))
        per_file.append(got)
    return [x for pair in zip(*per_file) for x in pair]


def _rename(code: str) -> str | None:
    fn = next(x for x in parse_python(code).body if isinstance(x, ast.FunctionDef) and x.args.args)
    old = fn.args.args[0].arg
    new = next((n for n in RENAMES if not re.search(rf"\b{n}\b", code)), None)
    return new and f"Rename the variable `{old}` to `{new}` everywhere it is used."


def _bug(code: str) -> tuple[str, str] | None:
    """(code with a bug put in, the instruction describing it) or None."""
    lines = code.split("\n")
    for pattern, repl, words in BUGS:
        for n, line in enumerate(lines, 1):
            if re.search(pattern, line) and not line.lstrip().startswith("#"):
                lines[n - 1] = re.sub(pattern, repl, line, count=1)
                return "\n".join(lines), f"Fix the bug: {words.format(n=n)}."
    return None


def edit_items(folder: Path) -> list[Item]:
    """One edit per snippet, the kinds in turn (a snippet that cannot take the kind's edit is passed
    to the next kind)."""
    out, kinds = [], 0
    for sid, code in _snippets(folder):
        kind = EDIT_KINDS[kinds % len(EDIT_KINDS)]
        if kind == "type_hints":
            file, instruction = code, "Add type hints to every function's parameters and return value."
        elif kind == "docstring":
            file, instruction = code, "Add a one-line docstring to every function saying what it does."
        elif kind == "rename":
            file, instruction = code, _rename(code)
        else:
            got = _bug(code)
            file, instruction = got if got else (code, None)
        if instruction is None:
            continue
        kinds += 1
        text = (f"{instruction}\n\n```python\n{file}```\n\nReply with the whole edited code in one "
                "```python block.")
        out.append(Item(f"{sid}/{kind}", f"edits/{kind}", [{"role": "user", "content": text}],
                        prediction=f"```python\n{file}```", max_new_tokens=MAX_NEW_TOKENS["edits"],
                        extra={"original": code}))
    return out


def load(workloads, bfcl: str | Path | None = None, corpora: str | Path | None = None,
         limit: int | None = None) -> list[Item]:
    """The items of each workload, `limit` per workload taken round-robin over its categories."""
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise HdError(f"unknown workload '{unknown[0]}'; known: {', '.join(WORKLOADS)}")
    out = []
    for w in workloads:
        if w == "edits":
            items = edit_items(find_folder(corpora, "--corpora", "shared/corpora", "codealpaca_2k.jsonl", CORPORA_WHERE))
        else:
            folder = find_folder(bfcl, "--bfcl", "shared/data/bfcl", "BFCL_v4_simple_python.json", BFCL_WHERE)
            items = tools_items(folder) if w == "tools" else json_items(folder)
        out += round_robin(items, limit)
    return out


def round_robin(items: list[Item], limit: int | None) -> list[Item]:
    groups: dict[str, list[Item]] = {}
    for it in items:
        groups.setdefault(it.category, []).append(it)
    out, i = [], 0
    while (limit is None or len(out) < limit) and any(i < len(g) for g in groups.values()):
        for g in groups.values():
            if i < len(g) and (limit is None or len(out) < limit):
                out.append(g[i])
        i += 1
    return out


# ---------------------------------------------------------------- checking answers

def problem(value, schema: dict, where: str = "$") -> str | None:
    """What makes value break the JSON Schema (the keywords the workloads use: type, enum, const,
    properties, required, additionalProperties, items, min/maxItems, min/maxLength, pattern,
    minimum/maximum, anyOf/oneOf), or None. Independent of the grammar engine on purpose."""
    if not isinstance(schema, dict) or not schema:
        return None
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
                  "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
                  "null": lambda v: v is None,
                  "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not any(checks.get(t, lambda v: True)(value) for t in names):
            return f"{where}: not of type {types}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: not one of {schema['enum']}"
    if "const" in schema and value != schema["const"]:
        return f"{where}: not {schema['const']!r}"
    for key in ("anyOf", "oneOf"):
        if key in schema and all(problem(value, s, where) for s in schema[key]):
            return f"{where}: matches none of {key}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in value:
                return f"{where}: lacks {k!r}"
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            sub = props.get(k, extra if isinstance(extra, dict) else None)
            if sub is None and extra is False:
                return f"{where}: {k!r} is not allowed"
            p = problem(v, sub, f"{where}.{k}") if isinstance(sub, dict) else None
            if p:
                return p
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            return f"{where}: {len(value)} items"
        for i, v in enumerate(value):
            p = problem(v, schema.get("items", {}), f"{where}[{i}]")
            if p:
                return p
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            return f"{where}: length {len(value)}"
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return f"{where}: does not match {schema['pattern']}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            return f"{where}: {value} out of range"
    return None


def check(item: Item, text: str, lm=None) -> dict:
    """{valid: the answer parses and validates, text: an `auto` answer that is plain text}."""
    if item.workload == "json":
        try:
            return {"valid": problem(json.loads(text), item.schema) is None, "text": False}
        except ValueError:
            return {"valid": False, "text": False}
    if item.workload == "edits":
        return {"valid": parse_python(code_of(text)) is not None, "text": False}
    family = tools.family(lm.tokenizer) if lm is not None else "hd"
    calls = tools.parse_calls(text, family, item.tools)
    if not calls:
        plain = item.tool_choice == "auto" and tools.OPENERS[family] not in text
        return {"valid": plain, "text": plain}
    by_name = {t.name: t for t in item.tools}
    for c in calls:
        tool = by_name.get(c["function"]["name"])
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            return {"valid": False, "text": False}
        if tool is None or problem(args, tool.parameters) is not None:
            return {"valid": False, "text": False}
    return {"valid": True, "text": False}


# ---------------------------------------------------------------- running

@dataclass
class Prepared:
    """What every method of one item shares: prompt ids, the grammar (hd's), its GBNF twin for
    llama.cpp, the prediction's ids."""
    prompt_ids: list[int]
    grammar: object = None
    gbnf: str | None = None
    prediction: list[int] | None = None


def call_schema(item: Item) -> dict:
    """JSON Schema of one call of the offered tools (llama.cpp's grammar for tool_choice required)."""
    calls = [_obj({"name": {"const": t.name}, "arguments": t.parameters}) for t in item.tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def prepare(lm, item: Item, llama: bool = False) -> Prepared:
    grammar = gbnf = None
    if item.workload == "tools":
        family = tools.family(lm.tokenizer)
        ids = tools.render(lm.tokenizer, item.messages, item.tools, family=family, max_tokens=lm.max_context)
        if item.tool_choice == "required":
            grammar = constrain.compile(lm, "lark", tools.call_grammar(item.tools, "required", item.parallel,
                                                                       family, lm.tokenizer))
            if llama:
                gbnf = _llama_gbnf(call_schema(item), wrap=family in ("hermes", "hd"), repeat=item.parallel)
    else:
        ids = encode_messages(lm.tokenizer, item.messages, max_tokens=lm.max_context)
        if item.schema is not None:
            grammar = constrain.compile(lm, "json_schema", item.schema)
            if llama:
                gbnf = _llama_gbnf(item.schema)
    room = lm.max_context - len(ids) - 1
    if room < 2:
        raise HdError(f"item {item.question_id}: its prompt of {len(ids)} tokens fills the model's context")
    prediction = prediction_ids(lm, item.prediction, room) if item.prediction else None
    return Prepared([int(t) for t in ids], grammar, gbnf, prediction)


def _llama_gbnf(schema: dict, wrap: bool = False, repeat: bool = False) -> str:
    """llama.cpp's own GBNF for a JSON schema (its converter), the call optionally wrapped in
    <tool_call> blocks (one, or one or more)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf
    text = json_schema_to_gbnf(json.dumps(schema))
    if not wrap:
        return _checked_gbnf(text)
    body = re.sub(r"^root\s*::=", "call ::=", text, count=1, flags=re.M)
    block = '"<tool_call>\\n" call "\\n</tool_call>"'
    return _checked_gbnf(f"root ::= {block}" + (f' ("\\n" {block})*' if repeat else "") + "\n" + body)


def _checked_gbnf(text: str) -> str:
    """text, once llama.cpp has parsed it: a schema its converter writes wrongly fails here, before
    any timing, not in the middle of a run."""
    from llama_cpp import LlamaGrammar
    try:
        LlamaGrammar.from_string(text, verbose=False)
    except ValueError as exc:
        raise HdError(f"method 'llama-cpp': llama.cpp cannot parse the grammar its converter wrote ({exc})") from None
    return text


def method_help() -> str:
    return runner.method_help(METHOD_HELP)


def check_methods(names) -> None:
    runner.check_methods(names, METHODS)


def default_methods(lm) -> list[str]:
    return ["ar", "hd"] + ["suffix"] * suffix.available() + ["llama-cpp"] * llamacpp.runs_model(lm.name)


class LlamaCppGrammar:
    """llama.cpp on the same GGUF, with the item's grammar as llama.cpp's own GBNF."""

    def __init__(self, lm):
        self.lm, self.llama = lm, LlamaCppModel(lm)

    def answer(self, prompt_ids, max_new_tokens, sampling, seed, gbnf: str | None = None):
        from llama_cpp import LlamaGrammar
        grammar = LlamaGrammar.from_string(gbnf, verbose=False) if gbnf else None
        tokens, wall = self.llama.answer(prompt_ids, max_new_tokens, sampling, seed, grammar=grammar)
        return runner.Turn(text=self.lm.tokenizer.decode(tokens, skip_special_tokens=True), tokens=tokens,
                           wall_time=wall, accept_lengths=[])


def make_runners(lm, names, cfg, dbs) -> dict:
    check_methods(names)
    runners = runner.make_runners(lm, [n for n in names if n != "llama-cpp"], cfg, dbs)
    if "llama-cpp" in names:
        runners["llama-cpp"] = LlamaCppGrammar(lm)
    return {n: runners[n] for n in names}


def answer(name: str, r, item: Item, prep: Prepared, sampling, seed, max_new_tokens: int | None):
    """One method's answer to one item: ar and suffix get the grammar, hd the grammar and the
    prediction, llama-cpp the grammar as GBNF."""
    n = min(max_new_tokens or item.max_new_tokens, r.lm.max_context - len(prep.prompt_ids) - 1)
    if name == "llama-cpp":
        return r.answer(prep.prompt_ids, n, sampling, seed, gbnf=prep.gbnf)
    return r.answer(prep.prompt_ids, n, sampling, seed, grammar=prep.grammar,
                    prediction=prep.prediction if name == "hd" else None)


def run(lm, items: list[Item], runners: dict, sampling, seed: int | None = 0,
        max_new_tokens: int | None = None, progress: Callable | None = None) -> tuple[dict, dict]:
    """(results[method] = [(item record, [Turn])], checks[method] = [check()]), methods interleaved
    per item (A B C, A B C, ...), each method's first call untimed."""
    warm_up(lm)
    preps = [prepare(lm, it, llama="llama-cpp" in runners) for it in items]
    # each method's first call (kernels, caches, the grammar path) is not timed; on a prompt of
    # its own, so that no method has seen an item before it is timed on it
    warm = Item("warm-up", "json/warm-up", [], max_new_tokens=8)
    warm_prep = Prepared(encode_prompt(lm.tokenizer, "Say hello in JSON."),
                         constrain.compile(lm, "json_object"), 'root ::= "{" [^}]* "}"')
    for name, r in runners.items():
        answer(name, r, warm, warm_prep, sampling, seed, 8)
    results = {m: [] for m in runners}
    checks = {m: [] for m in runners}
    total = len(items) * len(runners)
    for it, prep in zip(items, preps):
        for name, r in runners.items():
            turn = answer(name, r, it, prep, sampling, seed, max_new_tokens)
            results[name].append((it.record(), [turn]))
            checks[name].append(check(it, turn.text, lm))
            if progress:
                progress(name, it, total)
    return results, checks


def summarize(results: dict, checks: dict, greedy: bool = True) -> dict:
    """runner.summarize's figures per method (overall and per category), per workload too, with
    the share of answers that parse and validate (`valid`) and of plain-text `auto` answers."""
    per_workload = {}
    for w in WORKLOADS:
        keep = {m: [(q, t) for q, t in rows if q["category"].startswith(w + "/")] for m, rows in results.items()}
        if keep["ar"]:
            s = runner.summarize(keep, greedy)
            for m in s:
                s[m]["overall"]["categories"] = list(s[m]["categories"])
            per_workload[w] = s
    out = {}
    for m in results:
        cats = {}
        for w, s in per_workload.items():
            cats.update(s[m]["categories"])
        out[m] = {"workloads": {w: s[m]["overall"] for w, s in per_workload.items()}, "categories": cats}
        for (q, turns), c in zip(results[m], checks[m]):
            for key in (q["category"], q["category"].split("/")[0]):
                f = cats[key] if key in cats else out[m]["workloads"][key]
                f["valid"] = f.get("valid", 0) + c["valid"]
                f["text"] = f.get("text", 0) + c["text"]
                f["grammar_seconds"] = f.get("grammar_seconds", 0.0) + sum(t.grammar_seconds for t in turns)
                f["grammar_rows"] = f.get("grammar_rows", 0) + sum(t.grammar_rows for t in turns)
        for f in list(cats.values()) + list(out[m]["workloads"].values()):
            f["valid_rate"] = f.get("valid", 0) / f["questions"]
            # what the grammar costs per verified row (masking, the cut and the forced draft)
            f["grammar_ms_per_row"] = 1000 * f["grammar_seconds"] / f["grammar_rows"] if f.get("grammar_rows") else None
    return out


def save(out: Path, report: dict, results: dict, checks: dict, items: list[Item]) -> None:
    """summary.json and answers/<method>.jsonl (one record per item: its answer, tokens, check)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "answers").mkdir(exist_ok=True)
    for m, rows in results.items():
        with open(out / "answers" / f"{m}.jsonl", "w", encoding="utf-8") as f:
            for it, (q, turns), c in zip(items, rows, checks[m]):
                t = turns[0]
                f.write(json.dumps({**q, "answer": t.text, "new_tokens": len(t.tokens), "wall_time": t.wall_time,
                                    "accept_lengths": t.accept_lengths, **c}) + "\n")
    (out / "summary.json").write_text(json.dumps(report, indent=1))


def table(report: dict):
    """Per method and workload: speed, acceptance, valid answers, answers unlike ar's; then what
    each layer adds (report.layer_table)."""
    from rich import box
    from rich.table import Table
    methods = report["methods"]
    lcpp = any("speedup_over_llama_cpp" in f for m in methods.values() for f in m["workloads"].values())
    t = Table(title=f"hd bench agents · {report['model']} · {report['dtype']} · {report['device']} · "
                    f"{report['questions']} questions", box=box.SIMPLE_HEAD, pad_edge=False,
              caption="acc: mean accepted tokens per step · valid: answers that parse and validate "
                      "(tools auto: plain-text answers count valid) · differ: answers unlike ar's · "
                      "g ms: the grammar's time per verified row")
    cols = ["method", "workload", "vs ar"] + ["vs lcpp"] * lcpp + ["tok/s", "acc", "valid", "differ", "g ms"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("method", "workload") else "right", no_wrap=True)
    by_method_workload = {}
    for m, f in methods.items():
        for w, o in f["workloads"].items():
            differ = f"{o['differ_from_ar']}/{o['questions']}" if "differ_from_ar" in o else "n/a"
            t.add_row(m, w, f"{o['speedup']:.2f}x",
                      *([f"{o['speedup_over_llama_cpp']:.2f}x" if "speedup_over_llama_cpp" in o else "-"] * lcpp),
                      f"{o['tokens_per_second']:.1f}",
                      "-" if o["mean_accepted_tokens"] is None else f"{o['mean_accepted_tokens']:.2f}",
                      f"{o['valid']}/{o['questions']}", differ,
                      "-" if o.get("grammar_ms_per_row") is None else f"{o['grammar_ms_per_row']:.3f}")
            by_method_workload[f"{m} {w}"] = {"overall": o}
    from rich.table import Table as Grid
    grid = Grid.grid()
    grid.add_row(t)
    grid.add_row(layer_table(by_method_workload))
    return grid
