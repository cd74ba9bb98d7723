{{/* Names and labels of the env chart. Prefixed with the chart name: an umbrella chart
shares one template namespace across its subcharts. */}}
{{- define "env.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- /* The Secret holding the secrets key: the operator's, or the one the chart makes. */ -}}
{{- define "env.secretsName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "env.fullname" . | trunc 55 | trimSuffix "-")) -}}
{{- end -}}

{{- define "env.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "env.labels" -}}
{{ include "env.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .Chart.Name }}
app.kubernetes.io/part-of: orchard
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "env.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "env.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "env.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* etcd client URLs: the chart's own list, else the umbrella's global list, else the etcd
StatefulSet the umbrella chart runs in this release. */}}
{{- define "env.etcdEndpoints" -}}
{{- $global := (.Values.global | default dict).etcd | default dict -}}
{{- if .Values.etcd.endpoints -}}
{{- toJson .Values.etcd.endpoints -}}
{{- else if $global.endpoints -}}
{{- toJson $global.endpoints -}}
{{- else if $global.bundled -}}
{{- toJson (list (printf "http://%s-etcd-client.%s.svc:2379" .Release.Name .Release.Namespace)) -}}
{{- else -}}
{{- fail "etcd.endpoints is empty: give the etcd client URLs (or install the orchard umbrella chart, which runs etcd)" -}}
{{- end -}}
{{- end -}}

{{/* ServiceMonitor or scrape annotations: "true"/"false" force, "auto" follows the cluster. */}}
{{- define "env.serviceMonitor" -}}
{{- $mode := toString .Values.metrics.serviceMonitor -}}
{{- if and .Values.metrics.enabled (or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1"))) -}}
true
{{- end -}}
{{- end -}}
