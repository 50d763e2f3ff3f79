"""Schemathesis against the served OpenAPI document: no 5xx, no hang, and a healthy server after.

Cases come from schemathesis, deterministically: its coverage phase (boundary values, type
mutations and unsupported methods for every operation, positive and negative) and Hypothesis
fuzzing of each operation in both generation modes with `derandomize=True`. A short table of
hostile JSON texts that no schema-driven generator writes (deep nesting, 20-digit and 5,000-digit
numbers, NaN, lone surrogates, invalid UTF-8) is sent to every POST route beside them. Requests go
out from a few threads so the tiny model's batches fill and the run stays within its budget; every
failure is collected and the assertion lists each distinct one with the request that caused it.
"""
from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET
from schemathesis.core.failures import Failure as CheckFailure
from schemathesis.core.failures import FailureGroup
from schemathesis.generation.drivers import CoverageGenerator
from schemathesis.generation.feedback import FeedbackSources
from schemathesis.generation.overrides import Override
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_schema_conformance, status_code_conformance)

from tests.e2e.server import launch

pytestmark = pytest.mark.e2e

NUM_FUZZ_EXAMPLES = 60  # per operation and generation mode, on top of the coverage phase
NUM_WORKERS = 4
MAX_CONCURRENT_REQUESTS = 8  # above NUM_WORKERS: a 429 would hide the case it answers
REQUEST_TIMEOUT_S = 15.0
RUN_BUDGET_S = 240.0
MAX_NO_RESPONSE = 4  # then the server is stuck or gone and the rest would only time out
# Not used: positive_data_acceptance (the schema cannot state token limits, so schema-valid
# requests get 422) and negative_data_rejection (a lenient field is not a bug of ours to fail on).
CONFORMANCE_CHECKS = (status_code_conformance, content_type_conformance)
# Pulling fetches whatever directory, file or Hub id a body names: fuzzed, it would copy directories
# and reach for the network. tests/e2e/test_model_lifecycle.py drives it, bad ids included
# (tests/e2e/test_ollama_api.py Ollama's).
NOT_FUZZED = {"POST /v1/models/pull", "POST /api/pull"}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    launched = launch(["--model-id", str(tiny_llama)], tmp_path_factory.mktemp("fuzz"),
                      extra=["--max-input-tokens", "32", "--max-total-tokens", "64",
                             "--max-batch-prefill-tokens", "64",
                             "--max-batch-total-tokens", "2048",
                             "--max-concurrent-requests", str(MAX_CONCURRENT_REQUESTS)])
    yield launched
    launched.stop()


@dataclass(frozen=True, slots=True)
class Probe:
    """One request: a schemathesis case, or a raw JSON text for a POST route."""
    method: str
    path: str
    case: object | None = None
    raw: bytes | None = None
    hostile_kind: str = ""  # what a raw body tries, whatever its route and field

    def body_text(self) -> str:
        if self.raw is not None:
            return repr(self.raw[:200]) + (f"... ({len(self.raw)} bytes)" if len(self.raw) > 200
                                           else "")
        body = self.case.body
        if body is NOT_SET:
            return "(none)"
        if isinstance(body, bytes):
            return repr(body)
        try:
            return json.dumps(body, ensure_ascii=False)
        except (TypeError, ValueError):
            return repr(body)


@dataclass(frozen=True, slots=True)
class Finding:
    """One bad answer, or none at all, to one request."""
    kind: str  # "server error", "no response", "conformance"
    probe: Probe
    status: int | None
    detail: str
    response_body: str = ""

    def key(self) -> tuple:
        # numbers in messages (token counts, ids) vary between otherwise identical findings
        if self.probe.hostile_kind:
            return self.kind, self.status, self.probe.hostile_kind
        return (self.kind, self.probe.method, self.probe.path, self.status,
                re.sub(r"\d+", "N", self.detail[:80]))

    def describe(self) -> str:
        text = (f"[{self.kind}] {self.probe.method} {self.probe.path} -> {self.status}: "
                f"{self.detail[:300]!r}\n    request body: {self.probe.body_text()[:400]}")
        if self.response_body and self.response_body != self.detail:
            text += f"\n    response body: {self.response_body[:300]!r}"
        return text


def _fuzz_cases(operation, mode: GenerationMode) -> list:
    """Hypothesis-drawn cases for one operation in one mode; none when none can exist."""
    cases = []

    @settings(max_examples=NUM_FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False)
    @given(operation.as_strategy(generation_mode=mode))
    def collect(case):
        cases.append(case)

    try:
        collect()
    except Unsatisfiable:  # a GET without parameters has no negative case
        pass
    return cases


def _coverage_cases(schema, operation) -> list:
    generator = CoverageGenerator(
        operation=operation, generation_modes=list(GenerationMode),
        generation_config=schema.config.generation_for(operation=operation, phase="coverage"),
        auth_storage=None, override=Override(), feedback=FeedbackSources())
    return list(generator)


def generated_probes(schema) -> Iterator[Probe]:
    """Operation by operation, so the first requests go out while the rest are drawn."""
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.label in NOT_FUZZED:
            continue
        cases = _coverage_cases(schema, operation)
        for mode in GenerationMode:
            cases.extend(_fuzz_cases(operation, mode))
        yield from (Probe(case.method.upper(), case.formatted_path, case=case) for case in cases)


_DEEP = "[" * 100_000 + "]" * 100_000
_NUMBERS = {"2**64": "18446744073709551616", "-2**63 - 1": "-9223372036854775809",
            "5,000 digits": "1" * 5000, "1e400": "1e400", "NaN": "NaN", "Infinity": "Infinity",
            "-0.0": "-0.0", "1e-400": "1e-400", "0.5": "0.5"}
_TEXTS = {"lone surrogate": '"\\ud800"', "NUL": '"a\\u0000b"', "deep nesting": _DEEP}
_NUMERIC_FIELDS = {  # the request's numeric parameters, per API family
    "tgi": ["top_k", "max_new_tokens", "seed", "temperature", "top_p", "typical_p",
            "repetition_penalty", "frequency_penalty", "top_n_tokens", "best_of", "truncate"],
    "chat": ["max_tokens", "temperature", "top_p", "n", "seed", "top_logprobs"],
    "completion": ["max_tokens", "temperature", "top_p", "n", "seed", "logprobs"],
}


def _template(path: str) -> tuple[str, str]:
    """A minimal valid body for `path` as a %-template (text, extra fields), and its family."""
    if path == "/v1/chat/completions":
        return '{"messages":[{"role":"user","content":%s}],"max_tokens":2%s}', "chat"
    if path == "/v1/completions":
        return '{"prompt":%s,"max_tokens":2%s}', "completion"
    return '{"inputs":%s,"parameters":{"max_new_tokens":2%s}}', "tgi"


def hostile_probes(paths: list[str]) -> list[Probe]:
    probes = []
    for path in paths:
        template, family = _template(path)
        bodies = {"deep nesting": _DEEP,
                  "deep nesting in parameters": f'{{"inputs":"hi","parameters":{_DEEP}}}',
                  "invalid UTF-8": b'{"inputs":"\xff\xfe"}'}
        bodies |= {f"text: {kind}": template % (text, "") for kind, text in _TEXTS.items()}
        bodies = [(kind, body) for kind, body in bodies.items()]
        bodies += [(f"number: {kind}", template % ('"hi"', f',"{name}":{number}'))
                   for name in _NUMERIC_FIELDS[family] for kind, number in _NUMBERS.items()]
        probes += [Probe("POST", path, raw=body if isinstance(body, bytes) else body.encode(),
                         hostile_kind=kind) for kind, body in bodies]
    return probes


def _check(probe: Probe, response) -> list[Finding]:
    findings = []
    if response.status_code >= 500:
        findings.append(Finding("server error", probe, response.status_code, response.text))
    if probe.case is None:
        return findings
    checks = list(CONFORMANCE_CHECKS)
    # an OpenAPI 3.0 schema for text/event-stream describes the event envelope, not each event
    content_type = response.headers.get("content-type", [""])[0]  # lists: one per header line
    if not content_type.startswith("text/event-stream"):
        checks.append(response_schema_conformance)
    try:
        probe.case.validate_response(response, checks=checks)
    except FailureGroup as group:  # one entry per failed check
        failures = group.exceptions
    except CheckFailure as failure:
        failures = [failure]
    else:
        failures = []
    findings += [Finding("conformance", probe, response.status_code,
                         f"{failure.title}: {failure.message}", response.text)
                 for failure in failures]
    return findings


def _send(probe: Probe, url: str, session: requests.Session):
    timeout = (5, REQUEST_TIMEOUT_S)
    if probe.case is not None:
        return probe.case.call(base_url=url, session=session, timeout=timeout)
    return session.post(f"{url}{probe.path}", data=probe.raw, timeout=timeout,
                        headers={"content-type": "application/json"})


@dataclass(slots=True)
class Run:
    """What the workers found; `num_sent` counts the probes that were sent."""
    probes: list[Probe] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    num_sent: int = 0
    num_no_response: int = 0
    is_aborted: bool = False


def send_all(probes: Iterable[Probe], server) -> Run:
    run = Run()
    lock, local = threading.Lock(), threading.local()

    def send(probe: Probe) -> None:
        if run.is_aborted:
            return
        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        started = time.monotonic()
        try:
            response = _send(probe, server.url, session)
            found = _check(probe, response)
            if time.monotonic() - started > REQUEST_TIMEOUT_S:
                found.append(Finding("no response", probe, response.status_code,
                                     f"answered after {REQUEST_TIMEOUT_S}s"))
        except requests.RequestException as error:
            found = [Finding("no response", probe, None, f"{type(error).__name__}: {error}")]
        with lock:
            run.num_sent += 1
            run.findings.extend(found)
            run.num_no_response += sum(f.kind == "no response" for f in found)
            if run.num_no_response >= MAX_NO_RESPONSE or server.process.poll() is not None:
                run.is_aborted = True

    pool, futures = ThreadPoolExecutor(NUM_WORKERS), []
    for probe in probes:
        if run.is_aborted:
            break
        run.probes.append(probe)
        futures.append(pool.submit(send, probe))
    _, pending = wait(futures, timeout=RUN_BUDGET_S)
    # a thread stuck on a trickling stream ends when the fixture stops the server
    pool.shutdown(wait=False, cancel_futures=True)
    if pending:
        run.is_aborted = True
        run.findings.append(Finding("no response", Probe("*", "*"), None,
                                    f"{len(pending)} probes unfinished after {RUN_BUDGET_S}s"))
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is not None:
            raise future.exception()  # a bug of this test, not of the server
    return run


def _distinct(findings: list[Finding]) -> list[tuple[Finding, int]]:
    """The first finding of each kind, with how many probes found the same."""
    seen, counts = {}, {}
    for finding in findings:
        seen.setdefault(finding.key(), finding)
        counts[finding.key()] = counts.get(finding.key(), 0) + 1
    return [(finding, counts[key]) for key, finding in seen.items()]


def server_tracebacks(log: str) -> list[str]:
    """Each distinct traceback in the launcher's log (keyed by its last frame and exception
    type), with the log line before it, which names the request."""
    lines = [re.sub(r"^\[[\w ]+\] ", "", line) for line in log.splitlines()]
    found = {}
    for start, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        end = start + 1
        while end < len(lines) and (lines[end].startswith(" ") or not lines[end].strip()):
            end += 1
        block = lines[max(start - 1, 0):end + 1]
        frames = [frame for frame in block if frame.lstrip().startswith("File ")]
        exception = lines[end].split(":")[0] if end < len(lines) else ""
        found.setdefault((frames[-1] if frames else "", exception), "\n".join(block))
    return list(found.values())


def _health(url: str) -> list[str]:
    problems = []
    try:
        health = requests.get(f"{url}/health", timeout=10)
        if health.status_code != 200:
            problems.append(f"GET /health -> {health.status_code}: {health.text[:200]}")
        reply = requests.post(f"{url}/generate", timeout=30,
                              json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        if reply.status_code != 200:
            problems.append(f"POST /generate -> {reply.status_code}: {reply.text[:200]}")
    except requests.RequestException as error:
        problems.append(f"server unreachable after the run: {error}")
    return problems


# its probes alone may take RUN_BUDGET_S (240 s) before it reports the ones left unanswered
@pytest.mark.timeout(600)
def test_fuzz_every_route(server):
    document_url = f"{server.url}/api-doc/openapi.json"
    schema = schemathesis.openapi.from_url(document_url, timeout=10)
    paths = schema.raw_schema["paths"]
    post_paths = sorted(path for path, item in paths.items()
                        if "post" in item and f"POST {path}" not in NOT_FUZZED)

    run = send_all(itertools.chain(generated_probes(schema), hostile_probes(post_paths)), server)
    problems = _health(server.url)
    num_generated = sum(probe.case is not None for probe in run.probes)
    print(f"{num_generated} generated and {len(run.probes) - num_generated} hostile probes, "
          f"{run.num_sent} sent, {len(run.findings)} findings")

    distinct = _distinct(run.findings)
    distinct.sort(key=lambda item: item[0].kind == "conformance")
    report = [f"{finding.describe()}\n    ({count} probes like it)" for finding, count in distinct]
    if run.is_aborted:
        report.insert(0, f"ABORTED after {run.num_sent} probes "
                         f"(launcher exit code: {server.process.poll()})")
    report += problems
    if report:
        tracebacks = server_tracebacks(server.log())
        report.append(f"--- {len(tracebacks)} distinct tracebacks in the server log ---")
        report += tracebacks
        if run.is_aborted:
            report.append("--- server log tail ---\n" + "\n".join(server.log().splitlines()[-40:]))
    assert not report, "\n".join(report)

    generated = [probe for probe in run.probes if probe.case is not None]
    assert num_generated >= 1000, num_generated
    # schemathesis leaves out the route that serves the document itself: it was just fetched
    documented = {f"{method.upper()} {path}" for path, item in paths.items() for method in item
                  if path != urlsplit(document_url).path} - NOT_FUZZED
    assert {probe.case.operation.label for probe in generated} == documented
    assert run.num_sent == len(run.probes)
