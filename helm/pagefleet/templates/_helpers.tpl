{{- define "pagefleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- /*
"<fullname>-<suffix>" within 63 characters (the fullname shortened, never the suffix): a
Service's name is a DNS label, and so is a Job's (its pods carry it as a label). Unchanged
for every release name short enough to fit.
*/ -}}
{{- define "pagefleet.componentName" -}}
{{- $base := include "pagefleet.fullname" .root -}}
{{- printf "%s-%s" ($base | trunc (int (sub 62 (len .suffix))) | trimSuffix "-") .suffix -}}
{{- end -}}

{{- define "pagefleet.labels" -}}
app.kubernetes.io/name: pagefleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagefleet.operatorSelector" -}}
app.kubernetes.io/name: pagefleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pagefleet.serviceAccountName" -}}
{{- default (printf "%s-operator" (include "pagefleet.fullname" .)) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "pagefleet.redisURL" -}}
{{- printf "redis://%s.%s.svc:6379/0" (include "pagefleet.componentName" (dict "root" . "suffix" "redis")) .Release.Namespace -}}
{{- end -}}

{{- define "pagefleet.redisSecret" -}}
{{- printf "%s-redis-auth" (include "pagefleet.fullname" .) -}}
{{- end -}}
