"""ServeOptions: how `hd serve` listens, admits and batches, each option declared once.

The decoding options are the run's DecodingConfig (hdcli/config.py); these are the server's own.
Like a DecodingConfig field, each declares its flag, help and default (config.option); the
fields with a flag are `hd serve`'s options (hdcli/flags.py), and Server takes them as keywords.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

from ..config import BOOL, INT, NUMBER, OPT_PATH, OPT_STR, STR, Kind, option
from ..errors import HdError

MAX_BODY = 1 << 20   # bytes: a request body beyond this is refused (413)
SERVE = "serve"


@dataclass
class ServeOptions:
    host: str = option("127.0.0.1", "--host", kind=STR, group=SERVE, help="Address to listen on (loopback by default).")
    port: int = option(8000, "--port", kind=INT, group=SERVE, help="Port (0: any free one; the chosen port is printed).")
    api_key: list[str] = option([], "--api-key", kind=Kind(lambda v: True, "", List[str]), group=SERVE,
                                help="Bearer token the /v1 routes require, one per tenant (repeatable; also "
                                "HD_API_KEY). Default: none, an open server.")
    api_keys_file: str | None = option(None, "--api-keys-file", kind=OPT_PATH, group=SERVE,
                                       help="More keys, one a line (KEY or NAME KEY; # comments).")
    learn_scope: str | None = option(None, "--learn-scope", kind=OPT_STR, group=SERVE, help="shared|key|user: "
                                     "whose learned drafts and cached prefixes a request may use (default: key "
                                     "with several keys, else shared; docs/serve.md).")
    protect_metrics: bool = option(False, "--protect-metrics", kind=BOOL, group=SERVE, help="/metrics takes "
                                   "the API key too (one key; default: open, like /health).")
    metrics_key: str | None = option(None, "--metrics-key", kind=OPT_STR, group=SERVE, envvar="HD_METRICS_KEY",
                                     help="The only bearer token /metrics takes, no tenant's key (also "
                                     "HD_METRICS_KEY). With several API keys /metrics answers to nothing "
                                     "else: it shows every tenant's requests.")
    max_batch: int = option(8, "--max-batch", kind=INT, group=SERVE, help="Requests decoded at once; their "
                            "verification forwards are batched into one.")
    max_queue: int = option(64, "--max-queue", kind=INT, group=SERVE, help="Requests waiting beyond those (then 503).")
    name: str | None = option(None, "--served-model-name", kind=OPT_STR, group=SERVE,
                              help="The model id clients send (default: the --model given).")
    drain_timeout: float = option(60.0, "--drain-timeout", kind=NUMBER, group=SERVE, help="Seconds SIGTERM "
                                  "waits for running requests before cancelling them.")
    body_timeout: float = option(30.0, "--body-timeout", kind=NUMBER, group=SERVE, help="Seconds a request "
                                 "has to send its whole body once its header arrived (then 408).")
    max_connections: int = option(512, "--max-connections", kind=INT, group=SERVE, help="Open connections at "
                                  "most; one beyond gets 503 (keep it under `ulimit -n`).")
    prefix_cache_mb: float = option(256, "--prefix-cache-mb", kind=NUMBER, group=SERVE, help="MiB of prompts' "
                                    "keys and values kept for later requests that start the same way (chat "
                                    "turns, shared system prompts); answers stay bit-identical. 0: off.")
    # not on the command line
    max_body: int = MAX_BODY
    keep_alive_timeout: float = 5.0
    header_timeout: float = 10.0

    def validate(self) -> "ServeOptions":
        """Raise an HdError naming the first bad option; return self."""
        if self.max_batch < 1 or self.max_queue < 0:
            raise HdError("--max-batch must be >= 1 and --max-queue >= 0")
        if not 0 <= self.port <= 65535:
            raise HdError(f"--port {self.port} is not a port: give 0..65535 (0: any free one)")
        if not (math.isfinite(self.drain_timeout) and self.drain_timeout >= 0):   # nan passes a plain `< 0`
            raise HdError(f"--drain-timeout must be a finite number of seconds >= 0, not {self.drain_timeout:g}")
        if self.max_connections < 1:
            raise HdError("--max-connections must be >= 1")
        if not (math.isfinite(self.prefix_cache_mb) and self.prefix_cache_mb >= 0):
            raise HdError("--prefix-cache-mb must be a finite number of MiB >= 0 (0: off), "
                          f"not {self.prefix_cache_mb:g}")
        if not (self.keep_alive_timeout > 0 and self.header_timeout > 0):
            raise HdError("the keep-alive and header timeouts must be > 0 seconds")
        if not (math.isfinite(self.body_timeout) and self.body_timeout > 0):
            raise HdError(f"--body-timeout must be a finite number of seconds > 0, not {self.body_timeout:g}")
        return self
