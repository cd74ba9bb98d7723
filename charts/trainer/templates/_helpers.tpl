{{/* Names and labels of the trainer chart. Prefixed with the chart name: an umbrella chart
shares one template namespace across its subcharts. */}}
{{- define "trainer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "trainer.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "trainer.labels" -}}
{{ include "trainer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .Chart.Name }}
app.kubernetes.io/part-of: orchard
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "trainer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "trainer.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "trainer.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* etcd client URLs: the chart's own list, else the umbrella's global list, else the etcd
StatefulSet the umbrella chart runs in this release. */}}
{{- define "trainer.etcdEndpoints" -}}
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
{{- define "trainer.serviceMonitor" -}}
{{- $mode := toString .Values.metrics.serviceMonitor -}}
{{- if and .Values.metrics.enabled (or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1"))) -}}
true
{{- end -}}
{{- end -}}

{{/* The artifact store of this chart's Pods, as JSON: the chart's own artifacts values over the
umbrella's global.artifacts. "claim" is the PersistentVolumeClaim to mount; neither it nor "url":
an emptyDir. */}}
{{- define "trainer.artifacts" -}}
{{- $global := (.Values.global | default dict).artifacts | default dict -}}
{{- $own := .Values.artifacts -}}
{{- $claim := "" -}}
{{- if $own.existingClaim -}}
{{- $claim = $own.existingClaim -}}
{{- else if ($own.persistence | default dict).enabled -}}
{{- $claim = printf "%s-artifacts" (include "trainer.fullname" .) -}}
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
{{- define "trainer.artifactsConfig" -}}
{{- $a := include "trainer.artifacts" . | fromJson -}}
{{- $config := dict "root" ($a.url | default (printf "file://%s" $a.mountPath)) -}}
{{- with $a.allowed }}{{ $_ := set $config "allowed" . }}{{ end -}}
{{- with $a.options }}{{ $_ := set $config "options" . }}{{ end -}}
{{- toJson $config -}}
{{- end -}}

{{/* The artifact volume's mount (a container's volumeMounts item), when the store is a volume. */}}
{{- define "trainer.artifactsMount" -}}
{{- $a := include "trainer.artifacts" . | fromJson -}}
{{- if not $a.url }}
- name: artifacts
  mountPath: {{ $a.mountPath }}
{{- end }}
{{- end -}}

{{/* The artifact volume (a Pod's volumes item): the claim, else an emptyDir. */}}
{{- define "trainer.artifactsVolume" -}}
{{- $a := include "trainer.artifacts" . | fromJson -}}
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
{{- define "trainer.artifactsEnvFrom" -}}
{{- $a := include "trainer.artifacts" . | fromJson -}}
{{- with $a.credentialsSecret }}
- secretRef:
    name: {{ . }}
{{- end }}
{{- end -}}

{{/* The worker group's labels (RayCluster Pods): its own app name, so the trainer's Service,
selector and PodDisruptionBudget never take a worker Pod. */}}
{{- define "trainer.workers.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-worker
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "trainer.workers.labels" -}}
{{ include "trainer.workers.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: trainer-worker
app.kubernetes.io/part-of: orchard
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The RayCluster's name; KubeRay serves its head at <name>-head-svc. */}}
{{- define "trainer.ray.name" -}}
{{- printf "%s-ray" (include "trainer.fullname" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The worker Pods of workers.kind=pods: the StatefulSet and its headless Service. */}}
{{- define "trainer.pods.name" -}}
{{- printf "%s-workers" (include "trainer.fullname" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* The Secret holding the key the trainer and its worker Pods share (its key "key"). */}}
{{- define "trainer.pods.secretName" -}}
{{- .Values.workers.pods.existingSecret | default (printf "%s-worker-key" (include "trainer.fullname" .)) -}}
{{- end -}}

{{- define "trainer.pods.keyDir" -}}
/etc/orchard-trainer-worker
{{- end -}}

{{- define "trainer.pods.keyFile" -}}
{{- printf "%s/key" (include "trainer.pods.keyDir" .) -}}
{{- end -}}

{{/* The worker group's part of the config file: what the controller reads to reach its ranks.
Empty for subprocess (the service's defaults). */}}
{{- define "trainer.workersConfig" -}}
{{- $w := .Values.workers -}}
{{- if eq $w.kind "ray" -}}
{{- $address := $w.ray.address | default (printf "ray://%s-head-svc.%s.svc:10001" (include "trainer.ray.name" .) .Release.Namespace) -}}
{{- toJson (dict "kind" $w.kind "ranks" (int $w.ranks) "ray" (dict "address" $address "gpus_per_rank" (int $w.gpusPerRank))) -}}
{{- else if eq $w.kind "pods" -}}
{{- $name := include "trainer.pods.name" . -}}
{{- $endpoints := list -}}
{{- range $i := until (int $w.ranks) -}}
{{- $endpoints = append $endpoints (printf "%s-%d.%s.%s.svc:%v" $name $i $name $.Release.Namespace $w.pods.port) -}}
{{- end -}}
{{- $pods := dict "endpoints" $endpoints "key_file" (include "trainer.pods.keyFile" .) "rendezvous_port" (int $w.pods.rendezvousPort) -}}
{{- $config := dict "kind" $w.kind "ranks" (int $w.ranks) "max_ranks" (int $w.ranks) "pods" $pods -}}
{{- /* torch's threads per rank: the worker Pod's whole CPUs (torch would count the node's). */ -}}
{{- $cpu := toString ((($w.resources | default dict).requests | default dict).cpu | default "") -}}
{{- if regexMatch "^[1-9][0-9]*$" $cpu -}}
{{- $_ := set $config "threads_per_rank" (int $cpu) -}}
{{- end -}}
{{- toJson $config -}}
{{- end -}}
{{- end -}}

{{/* The store must reach every worker: a worker group on other nodes cannot use an emptyDir. */}}
{{- define "trainer.workers.check" -}}
{{- $a := include "trainer.artifacts" . | fromJson -}}
{{- if and (ne .Values.workers.kind "subprocess") (not $a.claim) -}}
{{- fail (printf "workers.kind=%s runs ranks on other nodes: they need a shared artifact store on a volume every Pod mounts (the ranks also share the trainer's scratch folder there, even when artifacts.url is an object store); set artifacts.existingClaim or artifacts.persistence.enabled (or global.artifacts in the umbrella chart)" .Values.workers.kind) -}}
{{- end -}}
{{- $persistence := .Values.artifacts.persistence | default dict -}}
{{- if and (ne .Values.workers.kind "subprocess") $persistence.enabled (not .Values.artifacts.existingClaim) (not (has "ReadWriteMany" $persistence.accessModes)) -}}
{{- fail (printf "artifacts.persistence.accessModes %v: worker Pods on other nodes mount the store; it needs ReadWriteMany" $persistence.accessModes) -}}
{{- end -}}
{{- if and (eq .Values.workers.kind "subprocess") .Values.workers.ray.address -}}
{{- fail "workers.ray.address is set but workers.kind is subprocess: set workers.kind=ray to train on that Ray cluster" -}}
{{- end -}}
{{- end -}}

{{/* The Pod spec of a RayCluster group: the trainer image (it carries Ray and the rank code),
non-root, the config file and the artifact store as in the trainer Pod. */}}
{{- define "trainer.ray.podSpec" -}}
{{- $root := .root -}}
{{- $w := $root.Values.workers -}}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $w.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
containers:
  - name: {{ .container }}
    image: {{ include "trainer.image" $root | quote }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    {{- with include "trainer.artifactsEnvFrom" $root }}
    envFrom:
      {{- . | nindent 6 }}
    {{- end }}
    env:
      - name: ORCHARD_TRAINER_CONFIG
        value: /etc/orchard/config.yaml
      - name: RAY_USAGE_STATS_ENABLED
        value: "0"
      {{- with $root.Values.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if .head }}
    ports:
      - name: gcs
        containerPort: 6379
        protocol: TCP
      - name: dashboard
        containerPort: 8265
        protocol: TCP
      - name: client
        containerPort: 10001
        protocol: TCP
    {{- end }}
    resources:
      {{- toYaml .resources | nindent 6 }}
    securityContext:
      allowPrivilegeEscalation: false
      capabilities:
        drop: ["ALL"]
    volumeMounts:
      - name: config
        mountPath: /etc/orchard
        readOnly: true
      - name: tmp
        mountPath: /tmp
      - name: shm
        mountPath: /dev/shm
      {{- include "trainer.artifactsMount" $root | nindent 6 }}
volumes:
  - name: config
    configMap:
      name: {{ include "trainer.fullname" $root }}
  - name: tmp
    emptyDir: {}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $w.sharedMemory }}
  {{- include "trainer.artifactsVolume" $root | nindent 2 }}
{{- with $w.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $w.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $w.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
