{{- define "orchard.etcd.name" -}}
{{- printf "%s-etcd" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "orchard.etcd.selectorLabels" -}}
app.kubernetes.io/name: etcd
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "orchard.etcd.labels" -}}
{{ include "orchard.etcd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.etcd.image.tag | quote }}
app.kubernetes.io/component: etcd
app.kubernetes.io/part-of: orchard
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
