"""The serving metrics operators watch: what DecoderService (serving/triton_model.py) records as it
decodes, and, inside Triton, the same numbers on Triton's Prometheus endpoint (`--metrics-port`),
beside Triton's own nv_* metrics, through the Python backend's custom-metric API.

Recorder keeps running totals in-process (no per-request history: a server runs for weeks);
TritonRecorder also forwards every observation to a pb_utils metric labelled with the model's name.
"""

from __future__ import annotations

# name, Prometheus kind, what it is (docs/DEPLOYMENT.md explains how to read each)
TIME_TO_FIRST_TOKEN = "diffexport_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "diffexport_inter_token_latency_seconds"
GENERATED_TOKENS = "diffexport_generated_tokens_total"
REQUESTS_WAITING = "diffexport_requests_waiting"
BATCH_ROWS = "diffexport_batch_rows"
METRICS = (
    (TIME_TO_FIRST_TOKEN, "histogram", "seconds from a request's arrival at the model to its first new token"),
    (INTER_TOKEN_LATENCY, "histogram", "seconds between consecutive new tokens of one request"),
    (GENERATED_TOKENS, "counter", "new tokens generated, every request together (end ids left out)"),
    (REQUESTS_WAITING, "gauge", "requests received and not yet decoding (queued, or their prompt being prefilled)"),
    (BATCH_ROWS, "gauge", "requests in the running decode batch"),
)
BUCKETS = {TIME_TO_FIRST_TOKEN: [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0],
           INTER_TOKEN_LATENCY: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]}


class Recorder:
    """Running totals of what the service observed (counts and sums of the histograms' values)."""

    def __init__(self):
        self.first_tokens = self.first_token_seconds = 0
        self.token_gaps = self.token_gap_seconds = 0
        self.tokens = self.waiting = self.rows = 0

    def first_token(self, seconds: float) -> None:
        self.first_tokens += 1
        self.first_token_seconds += seconds

    def token_gap(self, seconds: float) -> None:
        self.token_gaps += 1
        self.token_gap_seconds += seconds

    def generated(self, count: int = 1) -> None:
        self.tokens += count

    def load(self, waiting: int, rows: int) -> None:
        self.waiting, self.rows = waiting, rows


class TritonRecorder(Recorder):
    """A Recorder whose observations also go to Triton's metrics (pb_utils: the Python backend's
    module, handed in so that nothing here imports Triton)."""

    def __init__(self, pb_utils, model: str):
        super().__init__()
        kinds = {"histogram": pb_utils.MetricFamily.HISTOGRAM, "counter": pb_utils.MetricFamily.COUNTER,
                 "gauge": pb_utils.MetricFamily.GAUGE}
        labels = {"model": model}
        self._families, self._metrics = [], {}  # the families must outlive their metrics
        for name, kind, description in METRICS:
            family = pb_utils.MetricFamily(name=name, description=description, kind=kinds[kind])
            self._families.append(family)
            self._metrics[name] = family.Metric(labels=labels, buckets=BUCKETS[name]) if name in BUCKETS \
                else family.Metric(labels=labels)

    def first_token(self, seconds: float) -> None:
        super().first_token(seconds)
        self._metrics[TIME_TO_FIRST_TOKEN].observe(seconds)

    def token_gap(self, seconds: float) -> None:
        super().token_gap(seconds)
        self._metrics[INTER_TOKEN_LATENCY].observe(seconds)

    def generated(self, count: int = 1) -> None:
        super().generated(count)
        self._metrics[GENERATED_TOKENS].increment(count)

    def load(self, waiting: int, rows: int) -> None:
        if (waiting, rows) != (self.waiting, self.rows):  # each set is a message to Triton's process
            self._metrics[REQUESTS_WAITING].set(waiting)
            self._metrics[BATCH_ROWS].set(rows)
        super().load(waiting, rows)
