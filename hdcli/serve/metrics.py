"""What `hd serve` exposes at /metrics (Prometheus text format, prometheus-client), in a registry
of its own so that several servers in one process (tests) do not share counters.

  hd_requests_total{endpoint,status}      requests answered, by HTTP status
  hd_prompt_tokens_total, hd_completion_tokens_total
  hd_steps_total                          verification steps of all requests
  hd_step_tokens_total                    tokens those steps produced (mean accepted = this / steps)
  hd_drafted_tokens_total{layer}          drafted tokens sent to verification, per drafting layer
  hd_accepted_drafts_total{layer}         of them, accepted (acceptance = accepted / drafted)
  hd_forwards_total, hd_forward_requests  verification forwards, and requests verified per forward
  hd_queue_length, hd_running_requests    waiting for a slot, decoding now
  hd_tokens_per_second                    completion tokens over the last `window` seconds
  hd_request_seconds, hd_time_to_first_token_seconds   histograms
  hd_learned_generations_total, hd_learned_keys_total, hd_learn_pending, hd_learn_dropped_total
  hd_prefix_cache_{lookups,hits,hit_tokens,stored_tokens,evicted_tokens}_total, hd_prefix_cache_bytes,
  hd_prefix_cache_entries                 the prefix cache (engine/decode/prefix.py), read when scraped

Who may read it (Readers): every series moves with each request, so a reader polling it sees
another client's requests as they finish (prompt tokens, cached prefix tokens, latency). With
several API keys (tenants) /metrics answers only to --metrics-key, an admin token that is no
tenant's key (403 without one, 401 to any other key, tenant keys included); with one key or none
it is open, or takes that key (--protect-metrics), or the metrics key.
"""
from __future__ import annotations

import hmac
import threading
import time
from collections import deque
from ..errors import HdError
from . import tenants
from .protocol import ApiError


class Metrics:
    def __init__(self, window: float = 10.0):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
        disable_created_metrics()  # the *_created series only double the page
        r = self.registry = CollectorRegistry()
        self.requests = Counter("hd_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("hd_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("hd_completion_tokens", "Generated tokens", registry=r)
        self.steps = Counter("hd_steps", "Verification steps", registry=r)
        self.step_tokens = Counter("hd_step_tokens", "Tokens produced by verification steps", registry=r)
        self.drafted = Counter("hd_drafted_tokens", "Drafted tokens verified", ["layer"], registry=r)
        self.accepted = Counter("hd_accepted_drafts", "Drafted tokens accepted", ["layer"], registry=r)
        self.forwards = Counter("hd_forwards", "Verification forwards", registry=r)
        self.forward_requests = Histogram("hd_forward_requests", "Requests verified per forward",
                                          buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.queue = Gauge("hd_queue_length", "Requests waiting for a decode slot", registry=r)
        self.running = Gauge("hd_running_requests", "Requests decoding now", registry=r)
        self.tps = Gauge("hd_tokens_per_second", f"Generated tokens per second over the last {window:g} s",
                         registry=r)
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
        self.latency = Histogram("hd_request_seconds", "Request latency", buckets=buckets, registry=r)
        self.ttft = Histogram("hd_time_to_first_token_seconds", "Time to first token", buckets=buckets,
                              registry=r)
        self.learned = Counter("hd_learned_generations", "Generations added to the model DB", registry=r)
        self.learned_keys = Counter("hd_learned_keys", "Model DB keys touched by learning", registry=r)
        self.learn_pending = Gauge("hd_learn_pending", "Generations waiting to be learned", registry=r)
        self.learn_dropped = Counter("hd_learn_dropped", "Generations not learned (queue full)", registry=r)
        self._window = window
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def step(self, requests: int, tokens: int) -> None:
        """One verification forward over `requests` requests that produced `tokens` tokens."""
        now = time.monotonic()
        self.forwards.inc()
        self.forward_requests.observe(requests)
        self.steps.inc(requests)
        self.step_tokens.inc(tokens)
        with self._lock:
            self._recent.append((now, tokens))
            self._tps(now)

    def _tps(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window:
            self._recent.popleft()
        self.tps.set(sum(n for _, n in self._recent) / self._window)

    def watch_prefix(self, cache) -> None:
        """Expose a PrefixCache's counters, read from it at each scrape (the decode loop counts)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        class Prefix:
            def collect(self):
                c = cache.summary()
                for key, what in (("lookups", "Prompts looked up in the prefix cache"),
                                  ("hits", "Prompts whose prefix was restored from the prefix cache"),
                                  ("hit_tokens", "Prompt tokens restored from the prefix cache"),
                                  ("stored_tokens", "Tokens stored in the prefix cache"),
                                  ("evicted_tokens", "Tokens evicted from the prefix cache")):
                    yield CounterMetricFamily(f"hd_prefix_cache_{key}", what, value=c[key])
                yield GaugeMetricFamily("hd_prefix_cache_bytes", "Bytes the prefix cache holds", value=c["bytes"])
                yield GaugeMetricFamily("hd_prefix_cache_entries", "Sequences the prefix cache holds",
                                        value=c["entries"])
        self.registry.register(Prefix())

    def render(self) -> bytes:
        from prometheus_client import generate_latest
        with self._lock:
            self._tps(time.monotonic())
        return generate_latest(self.registry)


class Readers:
    """Who may read /metrics (module header). keys: serve/tenants.Keys or None; admin_key: the
    --metrics-key; protect: --protect-metrics."""

    def __init__(self, keys, admin_key: str | None = None, protect: bool = False):
        tenants_n = len(keys) if keys is not None else 0
        self.admin = tenants.check_key(admin_key, "--metrics-key").encode() if admin_key is not None else None
        if self.admin is not None and keys is not None and any(hmac.compare_digest(self.admin, key)
                                                               for _, key in keys.named):
            raise HdError("--metrics-key is also an API key: give the metrics reader a key no tenant has")
        if protect and tenants_n > 1 and self.admin is None:
            raise HdError(f"--protect-metrics with {tenants_n} API keys would show each tenant the others' "
                          "requests: give --metrics-key (a key of its own for whoever reads /metrics)")
        if protect and keys is None and self.admin is None:
            raise HdError("--protect-metrics needs an API key (--api-key or --api-keys-file) or --metrics-key")
        self.keys, self.protect, self.tenants = keys, protect, tenants_n

    def check(self, authorization: str) -> None:
        """Nothing where a request with this Authorization header may read /metrics, else ApiError."""
        scheme, _, token = authorization.partition(" ")
        token = token.strip().encode("utf-8", "replace") if scheme.lower() == "bearer" else b""
        if self.admin is not None:
            if not hmac.compare_digest(token, self.admin):
                raise ApiError(401, "/metrics takes the --metrics-key only: send 'Authorization: Bearer "
                               "<metrics key>'", code="invalid_api_key")
        elif self.tenants > 1:
            raise ApiError(403, f"/metrics would show each of this server's {self.tenants} tenants the "
                           "others' requests: start it with --metrics-key to read it", code="metrics_disabled")
        elif self.protect and self.keys.identify(token.decode("utf-8", "replace")) is None:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def describe(self) -> str:
        """For the start line."""
        if self.admin is not None:
            return "/metrics takes the --metrics-key only"
        if self.tenants > 1:
            return "/metrics off (several tenants: --metrics-key to read it)"
        if self.protect:
            return "/metrics takes the API key"
        return "/metrics open" + (" (--protect-metrics to require the key)" if self.tenants else "")
