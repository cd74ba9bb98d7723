{{/* Names and labels of the reward chart. Prefixed with the chart name: an umbrella chart
shares one template namespace across its subcharts. */}}
{{- define "reward.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "reward.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "reward.labels" -}}
{{ include "reward.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .Chart.Name }}
app.kubernetes.io/part-of: orchard
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "reward.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "reward.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "reward.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The env service's gRPC address (env.endpoint of the reward config): the chart's own, else
the umbrella's global.envService.endpoint, else the env Service the umbrella runs in this release
(named as the env chart names it), else none. */}}
{{- define "reward.envEndpoint" -}}
{{- $global := (.Values.global | default dict).envService | default dict -}}
{{- if .Values.envService.endpoint -}}
{{- .Values.envService.endpoint -}}
{{- else if $global.endpoint -}}
{{- $global.endpoint -}}
{{- else if $global.bundled -}}
{{- $name := ternary .Release.Name (printf "%s-env" .Release.Name) (contains "env" .Release.Name) | trunc 63 | trimSuffix "-" -}}
{{- printf "%s.%s.svc:%v" $name .Release.Namespace ($global.port | default 7100) -}}
{{- end -}}
{{- end -}}

{{/* ServiceMonitor or scrape annotations: "true"/"false" force, "auto" follows the cluster. */}}
{{- define "reward.serviceMonitor" -}}
{{- $mode := toString .Values.metrics.serviceMonitor -}}
{{- if and .Values.metrics.enabled (or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1"))) -}}
true
{{- end -}}
{{- end -}}
