"""Prometheus metrics under TGI's names and labels, in a registry of their own.

TGI's exporter writes counters without the `_total` suffix that prometheus_client insists on, so
counters are kept and written here; histograms and gauges use prometheus_client as is.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# TGI's duration buckets: 35 geometric steps from 150 microseconds, x1.5 each
DURATION_BUCKETS = tuple(0.00015 * 1.5 ** i for i in range(35))


class _Counters:
    """Counters by name and label values; collected with TGI's exact names."""

    def __init__(self):
        self._docs: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._values: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))

    def declare(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> None:
        self._docs[name] = (doc, labels)
        if not labels:
            self._values[name][()] += 0.0

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        _, names = self._docs[name]
        self._values[name][tuple(labels[n] for n in names)] += amount

    def forget(self, name: str, **labels: str) -> None:
        """Drops one labelled series (an unloaded adapter's: names come and go at run time)."""
        _, names = self._docs[name]
        self._values[name].pop(tuple(labels[n] for n in names), None)

    def value(self, name: str, **labels: str) -> float:
        _, names = self._docs[name]
        return self._values[name].get(tuple(labels[n] for n in names), 0.0)

    def render(self) -> str:
        lines = []
        for name, (doc, label_names) in self._docs.items():
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            for values, amount in self._values[name].items():
                labels = ",".join(f'{k}="{v}"' for k, v in zip(label_names, values))
                lines.append(f"{name}{{{labels}}} {amount}" if labels else f"{name} {amount}")
        return "\n".join(lines) + "\n"


class Metrics:
    def __init__(self, *, max_input_tokens: int, max_total_tokens: int,
                 adapter_requests: Callable[[], tuple[Counter, Counter]] | None = None):
        self.registry = CollectorRegistry()
        self.counters = _Counters()
        c = self.counters
        c.declare("tgi_request_count", "Requests received")
        c.declare("tgi_request_success", "Requests that ended with a generation")
        c.declare("tgi_request_failure", "Requests that failed, by cause", ("err",))
        c.declare("tgi_batch_concat", "New batches merged into the running one", ("reason",))
        for suffix, doc in (("count", "Shard calls"), ("success", "Shard calls that succeeded"),
                            ("failure", "Shard calls that failed")):
            c.declare(f"tgi_batch_inference_{suffix}", doc, ("method",))
        c.declare("tgi_prefix_cache_hits", "Prompt tokens served from the prefix cache")
        c.declare("tgi_speculation_draft_tokens", "Draft tokens decode steps verified (--speculate)")
        c.declare("tgi_speculation_accepted_tokens", "Draft tokens that became output tokens")
        # not TGI's (its metrics carry no adapter): requests that named a LoRA adapter
        c.declare("tgi_request_adapter_count", "Requests admitted on a LoRA adapter, by adapter",
                  ("adapter",))
        r = self.registry

        def duration(name, doc, labels=()):
            return Histogram(name, doc, labels, buckets=DURATION_BUCKETS, registry=r)

        self.request_duration = duration("tgi_request_duration", "End-to-end request time (s)")
        self.validation_duration = duration("tgi_request_validation_duration", "Validation time (s)")
        self.queue_duration = duration("tgi_request_queue_duration", "Time in the queue (s)")
        self.inference_duration = duration("tgi_request_inference_duration", "Time in batches (s)")
        self.time_per_token = duration("tgi_request_mean_time_per_token_duration",
                                       "Inference time per generated token (s)")
        linear = lambda top: tuple(top * (i + 1) / 100 for i in range(100))  # noqa: E731
        self.generated_tokens = Histogram("tgi_request_generated_tokens", "Tokens generated", [],
                                          buckets=linear(max_total_tokens), registry=r)
        self.input_length = Histogram("tgi_request_input_length", "Prompt tokens", [],
                                      buckets=linear(max_input_tokens), registry=r)
        self.max_new_tokens = Histogram("tgi_request_max_new_tokens", "Requested max_new_tokens", [],
                                        buckets=linear(max_total_tokens), registry=r)
        self.queue_size = Gauge("tgi_queue_size", "Requests waiting", registry=r)
        self.batch_current_size = Gauge("tgi_batch_current_size", "Requests in the running batch",
                                        registry=r)
        self.batch_current_max_tokens = Gauge("tgi_batch_current_max_tokens",
                                              "KV tokens held by the running batch", registry=r)
        self.batch_max_total_tokens = Gauge("tgi_batch_max_total_tokens", "KV tokens in the pool",
                                            registry=r)
        self.kv_free_blocks = Gauge("tgi_kv_cache_free_blocks", "KV blocks free now", registry=r)
        self.kv_prefix_blocks = Gauge("tgi_kv_cache_prefix_blocks",
                                      "KV blocks the prefix cache holds (evicted when needed)",
                                      registry=r)
        self.kv_session_blocks = Gauge("tgi_kv_cache_session_blocks",
                                       "KV blocks /api/generate-one|batch sessions hold",
                                       registry=r)
        self.sessions = Gauge("tgi_sessions", "request_id sessions remembered", registry=r)
        self.kv_total_blocks = Gauge("tgi_kv_cache_total_blocks", "KV blocks the router can hand out",
                                     registry=r)
        self.batch_next_size = Histogram("tgi_batch_next_size", "Requests in each new batch", [],
                                         buckets=tuple(2 ** i for i in range(11)), registry=r)
        self.batch_inference_duration = duration("tgi_batch_inference_duration",
                                                 "Shard call time seen by the router (s)", ("method",))
        self.batch_forward_duration = duration("tgi_batch_forward_duration",
                                               "Model forward time on the shard (s)", ("method",))
        self.batch_decode_duration = duration("tgi_batch_decode_duration",
                                              "Sampling and detokenisation time on the shard (s)",
                                              ("method",))
        self.batch_filter_duration = duration("tgi_batch_filter_duration",
                                              "Delivering tokens and filtering the batch (s)",
                                              ("method",))
        self.batch_concat_duration = duration("tgi_batch_concat_duration",
                                              "Merging batches on the shard (s)", ("method",))
        self.speculation_acceptance_rate = Gauge(
            "tgi_speculation_acceptance_rate",
            "Share of the draft tokens verified so far that were accepted", registry=r)
        self.adapters_loaded = Gauge("tgi_lora_adapters_loaded", "LoRA adapters loaded",
                                     registry=r)
        # (waiting, running) requests by LoRA adapter, read when scraped (the scheduler's)
        self.adapter_requests = adapter_requests
        r.register(_AdapterRequests(self))

    def observe_speculation(self, drafted: int, accepted: int) -> None:
        self.counters.inc("tgi_speculation_draft_tokens", drafted)
        self.counters.inc("tgi_speculation_accepted_tokens", accepted)
        self.speculation_acceptance_rate.set(
            self.counters.value("tgi_speculation_accepted_tokens")
            / self.counters.value("tgi_speculation_draft_tokens"))

    def render(self) -> bytes:
        return self.counters.render().encode() + generate_latest(self.registry)


class _AdapterRequests:
    """Queued and running requests per LoRA adapter, counted when scraped.

    Samples of tgi_queue_size and tgi_batch_current_size labelled by adapter (not TGI's), from the
    scheduler's requests: one per adapter that has any."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> list:
        return []  # collected lazily: the registry must not call collect() at registration

    def collect(self):
        source = self.metrics.adapter_requests
        waiting, running = source() if source is not None else (Counter(), Counter())
        for name, doc, counts in (
                ("tgi_adapter_queue_size", "Requests waiting, by LoRA adapter", waiting),
                ("tgi_adapter_batch_current_size", "Requests in the running batch, by LoRA "
                                                   "adapter", running)):
            family = GaugeMetricFamily(name, doc, labels=["adapter"])
            for adapter, count in sorted(counts.items()):
                family.add_metric([adapter], count)
            yield family


def render_models(models: dict[str, Metrics]) -> bytes:
    """One Prometheus exposition for several models.

    One model's metrics as they are (what a one-model server has always shown); several models'
    samples each labelled `model`, one family each."""
    if len(models) == 1:
        return next(iter(models.values())).render()
    families: dict[str, list[str]] = {}
    for model, metrics in models.items():
        family: list[str] = []
        for line in metrics.render().decode().splitlines():
            if line.startswith("# HELP "):
                family = families.setdefault(line.split(" ", 3)[2], [])
                if not family:
                    family.append(line)
            elif line.startswith("# TYPE "):
                if len(family) == 1:
                    family.append(line)
            elif line:
                family.append(_labelled(line, model))
    return "".join(line + "\n" for lines in families.values() for line in lines).encode()


def _labelled(sample: str, model: str) -> str:
    """`name{a="b"} 1` -> `name{model="m",a="b"} 1`.

    Pulled ids need no escaping; a default model given as a path may hold any character."""
    model = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    name, brace, rest = sample.partition("{")
    if brace:
        return f'{name}{{model="{model}",{rest}'
    name, _, value = sample.partition(" ")
    return f'{name}{{model="{model}"}} {value}'
