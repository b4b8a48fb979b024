{{- /*
The SLO rule groups (recording + alerting), shared by the PrometheusRule and by the tests,
which render this chart and run the groups through promtool and a real Prometheus.

Goodput is read from the daemons' histogram buckets: the share of requests whose TTFT
(TPOT) was at most the target is bucket{le=target} / count, so a target must be a bucket
boundary (values.schema.json enumerates them). Burn-rate alerts follow the multiwindow
scheme: error ratio over a long and a short window both above factor x (1 - objective).
Each request counts once, on the pod that answers it (role != prefill: unified or decode).
TPOT is read there alone. A TTFT miss is one on any pod: behind prefill/decode a prompt
prefilled remotely records its TTFT on the prefill pod (prefill) and again on the decode
pod (from the pulled KV to the first token), one prefilled locally (short uncached part,
prefill pool saturated or failed) on the decode pod alone. So TTFT misses are summed over
every role and divided by the requests answered: reading the prefill pods alone left the
locally prefilled requests out (all of them once the prefill pool saturates), and dividing
by both pools' counts would top a miss in one pool out at 0.5. A remote request missing on
both pods counts twice, hence the clamp at 1.
*/ -}}
{{- define "pagefleet.sloRuleGroups" -}}
{{- $a := .Values.alerts -}}
{{- $budget := printf "(1 - %v)" $a.slo.objective -}}
{{- $by := "namespace, inferenceservice" -}}
groups:
  - name: pagefleet-slo-recording
    rules:
      {{- range $w := list "5m" "30m" "1h" "6h" }}
      {{- $m := "vllm:time_to_first_token_seconds" }}
      - record: pagefleet:ttft_slo_error_ratio:rate{{ $w }}
        expr: clamp_max((sum by ({{ $by }}) (rate({{ $m }}_count[{{ $w }}])) - sum by ({{ $by }}) (rate({{ $m }}_bucket{le="{{ $a.slo.ttftSeconds }}"}[{{ $w }}]))) / sum by ({{ $by }}) (rate({{ $m }}_count{role!="prefill"}[{{ $w }}])), 1)
      {{- $m = "vllm:request_time_per_output_token_seconds" }}
      - record: pagefleet:tpot_slo_error_ratio:rate{{ $w }}
        expr: 1 - sum by ({{ $by }}) (rate({{ $m }}_bucket{le="{{ $a.slo.tpotSeconds }}", role!="prefill"}[{{ $w }}])) / sum by ({{ $by }}) (rate({{ $m }}_count{role!="prefill"}[{{ $w }}]))
      {{- end }}
      - record: pagefleet:ttft_seconds:p95_5m
        expr: histogram_quantile(0.95, sum by (le, {{ $by }}, role) (rate(vllm:time_to_first_token_seconds_bucket[5m])))
      - record: pagefleet:tpot_seconds:p95_5m
        expr: histogram_quantile(0.95, sum by (le, {{ $by }}, role) (rate(vllm:request_time_per_output_token_seconds_bucket[5m])))
  - name: pagefleet-slo-alerts
    rules:
      {{- range $sli := list (list "ttft" "TTFT" "time to first token" $a.slo.ttftSeconds "Add prefill capacity (roles.prefill / unified replicas or autoscaling.maxReplicas) or check the prefix-cache hit rate.") (list "tpot" "TPOT" "time per output token" $a.slo.tpotSeconds "Add decode capacity or lower engine.maxNumSeqs.") }}
      {{- range $burn := list (list "Fast" $a.fastBurn "1h" "5m" "critical") (list "Slow" $a.slowBurn "6h" "30m" "warning") }}
      {{- $b := index $burn 1 }}
      - alert: Pagefleet{{ index $sli 1 }}ErrorBudgetBurn{{ index $burn 0 }}
        expr: pagefleet:{{ index $sli 0 }}_slo_error_ratio:rate{{ index $burn 2 }} > ({{ $b.factor }} * {{ $budget }}) and pagefleet:{{ index $sli 0 }}_slo_error_ratio:rate{{ index $burn 3 }} > ({{ $b.factor }} * {{ $budget }})
        for: {{ $b.for }}
        labels: {severity: {{ index $burn 4 }}}
        annotations:
          summary: "{{`{{ $labels.namespace }}/{{ $labels.inferenceservice }}`}}: {{ index $sli 2 }} SLO burning its error budget {{ $b.factor }}x too fast"
          description: "{{`{{ $value | humanizePercentage }}`}} of requests took longer than {{ index $sli 3 }}s over {{ index $burn 2 }} (objective {{ $a.slo.objective }}). {{ index $sli 4 }}"
      {{- end }}
      {{- end }}
      - alert: PagefleetQueueBacklog
        expr: sum by ({{ $by }}) (vllm:num_requests_waiting) > {{ $a.queueWaitingMax }}
        for: {{ $a.for }}
        labels: {severity: warning}
        annotations:
          summary: "{{`{{ $labels.namespace }}/{{ $labels.inferenceservice }}`}}: {{`{{ $value }}`}} requests waiting"
          description: "Requests are queueing in the daemons; scale the roles out."
      - alert: PagefleetKVCacheFull
        expr: max by ({{ $by }}, pod) (vllm:kv_cache_usage_perc) > {{ $a.kvUsageMax }}
        for: {{ $a.for }}
        labels: {severity: info}
        annotations:
          summary: "{{`{{ $labels.pod }}`}}: KV cache above {{ $a.kvUsageMax }} used"
          description: "Expect preemptions; raise engine.kvCacheMemoryMB or add replicas."
      - alert: PagefleetIndexDown
        expr: min by ({{ $by }}, pod) (pagefleet:kv_index_up) == 0
        for: 5m
        labels: {severity: warning}
        annotations:
          summary: "{{`{{ $labels.pod }}`}} cannot reach the prefix index (Redis)"
          description: "Cache-aware routing degrades to load-only; check spec.index.redisURL and Redis."
{{- end -}}
