"""Command-line options made from declarations: a command names the fields it takes, and gets
their objects built.

A DecodingConfig field (hdcli/config.py) or a ServeOptions field (hdcli/serve/options.py)
declares its flags, help, default and what it takes once; `takes` turns the fields a command
names into typer options and hands the command the object they make:

    @app.command()
    @flags.takes(DecodingConfig, flags.groups("model", "sampling"), into="cfg", max_new_tokens={"default": 128})
    def cmd(cfg: DecodingConfig, ...): ...

Per command, a field's default or help may differ (`name={"default": ..., "help": ...}`).
With config_file, the command also takes --config FILE: the file's configuration, with the
options given on the command line taking precedence.
"""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Callable, Iterable, Optional

import typer

from .config import DecodingConfig

_CONTEXT = "hd_context"   # the parameter the command's context comes in
CONFIG_HELP = ("A run's configuration (JSON): a bare one, the --json output of a run (its \"config\"), or "
               "a plan from `hd plan --out`. Options given here override it.")


def groups(*names: str, cls=DecodingConfig, leave_out: Iterable[str] = ()) -> list[str]:
    """The fields of cls in these groups (all, without names), in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if "group" in f.metadata and f.name not in leave_out
            and (not names or f.metadata["group"] in names)]


# the target model and how it runs, as most commands take it (the invariant attention's kernel aside)
MODEL = groups("model", leave_out=["attention"])


def _parameter(f: dataclasses.Field, change: dict) -> inspect.Parameter:
    meta = {**f.metadata, **change}
    default = meta.get("default", meta.get("cli_default", f.default if f.default is not dataclasses.MISSING
                                           else f.default_factory()))
    extra = {k: v for k, v in meta.items() if k in ("envvar",)}
    info = typer.Option(default, *meta["flags"], help=meta.get("help"), **extra)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info,
                             annotation=meta.get("cli", meta["kind"].cli))


def takes(cls, names: Iterable[str], *, into: str, config_file: bool = False, **changes: dict) -> Callable:
    """A decorator: the command gets the options of cls's fields `names` (typer options from
    their declarations, changed per field by `changes`) and, as keyword `into`, the cls they make."""
    names = list(names)
    fields = {f.name: f for f in dataclasses.fields(cls)}

    def wrap(body: Callable) -> Callable:
        sig = inspect.signature(body, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != into]
        added = [_parameter(fields[n], changes.get(n, {})) for n in names]
        if config_file:   # the context tells options given from defaults (typer vendors its own click)
            added[:0] = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                           default=typer.Option(None, "--config", help=CONFIG_HELP)),
                         inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]

        def command(**kw):
            values = {n: kw.pop(n) for n in names}
            file, ctx = (kw.pop("config"), kw.pop(_CONTEXT)) if config_file else (None, None)
            kw[into] = build(cls, values, file, ctx)
            return body(**kw)
        command.__name__, command.__doc__ = body.__name__, body.__doc__
        command.__signature__ = sig.replace(parameters=own + added)
        return command
    return wrap


def build(cls, values: dict, config_file: Optional[Path] = None, ctx: Optional[typer.Context] = None):
    """The cls of these option values: a DecodingConfig checked by from_dict; with --config FILE,
    the file's, with the options given on the command line (ctx tells which) taking precedence."""
    if cls is not DecodingConfig:
        return cls(**values)
    base = cls.from_file(config_file) if config_file is not None else None
    if base is not None:
        values = {n: v for n, v in values.items()
                  if getattr(ctx.get_parameter_source(n), "name", "") not in ("DEFAULT", "DEFAULT_MAP")}
    cfg = cls.from_dict({**(base.to_dict() if base else {}), **values}, where="options")
    # a plan given as the --config is read once: its document goes with it (with_plan)
    if base is not None and base.plan_document is not None:
        cfg = cfg.replace(plan_document=base.plan_document)
    return cfg
