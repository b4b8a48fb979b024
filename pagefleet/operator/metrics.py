"""The operator's own Prometheus metrics (one registry per operator; docs/metrics.md).

Labels ``namespace``, ``service`` (the InferenceService) and ``role`` say which role a
series is about; ``input`` names one autoscaler input. Served by ``pagefleet operator
--metrics-port``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pagefleet.operator.planner import Decision, RoleObservation

ROLE = ("namespace", "service", "role")


class OperatorMetrics:
    """Every series of the operator, in ``self.registry``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.desired = Gauge(
            "pagefleet_operator_role_desired_replicas",
            "Replicas the autoscaler's last decision asked for.",
            ROLE,
            registry=r,
        )
        self.current = Gauge(
            "pagefleet_operator_role_current_replicas",
            "Replicas the role's Deployment asked for when the autoscaler decided.",
            ROLE,
            registry=r,
        )
        self.ready = Gauge(
            "pagefleet_operator_role_ready_replicas",
            "Ready pods of the role when the autoscaler decided.",
            ROLE,
            registry=r,
        )
        self.recommended = Gauge(
            "pagefleet_operator_role_recommended_replicas",
            "Replicas the measured load alone asks for (before windows, steps, bounds).",
            ROLE,
            registry=r,
        )
        self.inputs = Gauge(
            "pagefleet_operator_autoscaler_input",
            "One autoscaler input of one role: prompt_tokens_per_second (uncached), "
            "generation_tokens_per_second, requests_per_second, running, waiting, kv_usage, "
            "ttft_seconds, tpot_seconds (at the SLO percentile), known_pods, unknown_pods.",
            [*ROLE, "input"],
            registry=r,
        )
        self.capacity = Gauge(
            "pagefleet_operator_role_capacity_tokens_per_second",
            "Learned per-replica capacity at the SLO (phase: prefill or decode).",
            [*ROLE, "phase"],
            registry=r,
        )
        self.decisions = Counter(
            "pagefleet_operator_autoscaler_decisions",
            "Autoscaler decisions by reason (ScaledUp, ScaledDown, Steady, InputsUnknown, ...).",
            [*ROLE, "reason"],
            registry=r,
        )
        self.passes = Counter(
            "pagefleet_operator_reconciles",
            "Handler runs by handler (reconcile, resync, autoscale).",
            ["handler"],
            registry=r,
        )
        self.errors = Counter(
            "pagefleet_operator_reconcile_errors",
            "Handler runs that failed, by handler.",
            ["handler"],
            registry=r,
        )
        self.duration = Histogram(
            "pagefleet_operator_reconcile_duration_seconds",
            "Wall time of one handler run, by handler.",
            ["handler"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )

    def forget(self, namespace: str, service: str, role: str | None = None) -> None:
        """Drop every series of one InferenceService (deleted: its last values would
        otherwise be exported until the operator restarts), or of one of its roles (no
        longer autoscaled, or removed from the spec)."""
        per_service: list[tuple[Gauge | Counter, tuple[str, ...]]] = [
            (self.desired, ROLE),
            (self.current, ROLE),
            (self.ready, ROLE),
            (self.recommended, ROLE),
            (self.inputs, (*ROLE, "input")),
            (self.capacity, (*ROLE, "phase")),
            (self.decisions, (*ROLE, "reason")),
        ]
        for metric, names in per_service:
            stale = {
                tuple(sample.labels[n] for n in names)
                for family in metric.collect()
                for sample in family.samples
                if (sample.labels.get("namespace"), sample.labels.get("service"))
                == (namespace, service)
                and (role is None or sample.labels.get("role") == role)
            }
            for values in stale:
                metric.remove(*values)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def record_decision(
        self,
        namespace: str,
        service: str,
        role: str,
        obs: RoleObservation,
        decision: Decision,
    ) -> None:
        labels = (namespace, service, role)
        self.desired.labels(*labels).set(decision.desired)
        self.current.labels(*labels).set(obs.current)
        self.ready.labels(*labels).set(obs.ready)
        if decision.recommendation is not None:
            self.recommended.labels(*labels).set(decision.recommendation)
        self.decisions.labels(*labels, decision.reason.value).inc()
        values = {
            "prompt_tokens_per_second": obs.prompt_tokens_per_s,
            "generation_tokens_per_second": obs.generation_tokens_per_s,
            "requests_per_second": obs.requests_per_s,
            "running": obs.running,
            "waiting": obs.waiting,
            "kv_usage": obs.kv_usage,
            "ttft_seconds": obs.ttft_s,
            "tpot_seconds": obs.tpot_s,
            "known_pods": obs.known_pods,
            "unknown_pods": obs.unknown_pods,
        }
        for name, value in values.items():
            if value is not None:
                self.inputs.labels(*labels, name).set(value)
        for phase, cap in (
            ("prefill", decision.state.prefill_capacity),
            ("decode", decision.state.decode_capacity),
        ):
            if cap is not None:
                self.capacity.labels(*labels, phase).set(cap)
