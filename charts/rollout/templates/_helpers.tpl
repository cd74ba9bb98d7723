{{/* Names and labels of the rollout chart. Prefixed with the chart name: an umbrella chart
shares one template namespace across its subcharts. */}}
{{- define "rollout.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rollout.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rollout.labels" -}}
{{ include "rollout.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .Chart.Name }}
app.kubernetes.io/part-of: orchard
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rollout.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rollout.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rollout.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* etcd client URLs: the chart's own list, else the umbrella's global list, else the etcd
StatefulSet the umbrella chart runs in this release. */}}
{{- define "rollout.etcdEndpoints" -}}
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

{{/* The env service's gRPC address (env.endpoint of the rollout config): the chart's own, else
the umbrella's global.envService.endpoint, else the env Service the umbrella runs in this release
(named as the env chart names it), else none (the service's default, 127.0.0.1:7100). */}}
{{- define "rollout.envEndpoint" -}}
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

{{/* The gui section of the config, as JSON: browser episodes in sandboxes of the browser image
(images/gui-browser), which holds the browser folder where the service looks for it in any
image but `host` (/opt/orchard-browser), so no browser_dir is written. */}}
{{- define "rollout.guiConfig" -}}
{{- $gui := .Values.gui -}}
{{- $image := printf "%s:%s" $gui.browserImage.repository (default .Chart.AppVersion $gui.browserImage.tag) -}}
{{- $config := dict "image" $image "site_port" (int $gui.sitePort) "chromium_sandbox" $gui.chromiumSandbox "action_timeout_s" $gui.actionTimeoutS "keep_last" (int $gui.keepLast) "format_failure_limit" (int $gui.formatFailureLimit) -}}
{{- $_ := set $config "viewport" (list (int $gui.viewport.width) (int $gui.viewport.height)) -}}
{{- $_ := set $config "browser_user" (ternary nil $gui.browserUser (kindIs "invalid" $gui.browserUser)) -}}
{{- with $gui.siteImage }}{{ $_ := set $config "site_image" . }}{{ end -}}
{{- toJson $config -}}
{{- end -}}

{{/* ServiceMonitor or scrape annotations: "true"/"false" force, "auto" follows the cluster. */}}
{{- define "rollout.serviceMonitor" -}}
{{- $mode := toString .Values.metrics.serviceMonitor -}}
{{- if and .Values.metrics.enabled (or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1"))) -}}
true
{{- end -}}
{{- end -}}

{{/* The artifact store of this chart's Pods, as JSON: the chart's own artifacts values over the
umbrella's global.artifacts. "claim" is the PersistentVolumeClaim to mount; neither it nor "url":
an emptyDir. */}}
{{- define "rollout.artifacts" -}}
{{- $global := (.Values.global | default dict).artifacts | default dict -}}
{{- $own := .Values.artifacts -}}
{{- $claim := "" -}}
{{- if $own.existingClaim -}}
{{- $claim = $own.existingClaim -}}
{{- else if ($own.persistence | default dict).enabled -}}
{{- $claim = printf "%s-artifacts" (include "rollout.fullname" .) -}}
{{- else if $global.existingClaim -}}
{{- $claim = $global.existingClaim -}}
{{- else if ($global.persistence | default dict).enabled -}}
{{- $claim = printf "%s-artifacts" .Release.Name -}}
{{- end -}}
{{- $url := $own.url | default ($global.url | default "") -}}
{{- if and $url $claim -}}
{{- fail (printf "artifacts: both the url %q and the volume claim %q are set; the store is one or the other (unset artifacts.url, or existingClaim and persistence.enabled)" $url $claim) -}}
{{- end -}}
{{- $options := $own.options | default ($global.options | default dict) -}}
{{- $secret := $own.credentialsSecret | default ($global.credentialsSecret | default "") -}}
{{- $allowed := $own.allowed | default ($global.allowed | default list) -}}
{{- toJson (dict "url" $url "claim" $claim "mountPath" $own.mountPath "options" $options "credentialsSecret" $secret "allowed" $allowed) -}}
{{- end -}}

{{/* The artifacts section of the service's config file. */}}
{{- define "rollout.artifactsConfig" -}}
{{- $a := include "rollout.artifacts" . | fromJson -}}
{{- $config := dict "root" ($a.url | default (printf "file://%s" $a.mountPath)) -}}
{{- with $a.allowed }}{{ $_ := set $config "allowed" . }}{{ end -}}
{{- with $a.options }}{{ $_ := set $config "options" . }}{{ end -}}
{{- toJson $config -}}
{{- end -}}

{{/* The artifact volume's mount (a container's volumeMounts item), when the store is a volume. */}}
{{- define "rollout.artifactsMount" -}}
{{- $a := include "rollout.artifacts" . | fromJson -}}
{{- if not $a.url }}
- name: artifacts
  mountPath: {{ $a.mountPath }}
{{- end }}
{{- end -}}

{{/* The artifact volume (a Pod's volumes item): the claim, else an emptyDir. */}}
{{- define "rollout.artifactsVolume" -}}
{{- $a := include "rollout.artifacts" . | fromJson -}}
{{- if not $a.url }}
- name: artifacts
  {{- if $a.claim }}
  persistentVolumeClaim:
    claimName: {{ $a.claim }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The object store's credentials (a container's envFrom items). */}}
{{- define "rollout.artifactsEnvFrom" -}}
{{- $a := include "rollout.artifacts" . | fromJson -}}
{{- with $a.credentialsSecret }}
- secretRef:
    name: {{ . }}
{{- end }}
{{- end -}}
