{{/* Names, labels and the pieces every zerokl workload shares. */}}

{{- define "zerokl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's object name prefix; a release already named after the chart is not repeated. */}}
{{- define "zerokl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "zerokl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Standard labels of every object. Call with (dict "root" $ "component" "decode"). */}}
{{- define "zerokl.labels" -}}
helm.sh/chart: {{ include "zerokl.chart" .root }}
{{ include "zerokl.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: zerokl
{{- end -}}

{{/* What selectors match: name, instance, component. */}}
{{- define "zerokl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "zerokl.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "zerokl.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "zerokl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "zerokl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* host:port of a role's Service, e.g. (dict "root" $ "role" "weight-store" "port" 50055). */}}
{{- define "zerokl.address" -}}
{{- printf "%s-%s:%v" (include "zerokl.fullname" .root) .role .port -}}
{{- end -}}

{{/* The OTLP endpoint spans go to: the value, else the chart's Jaeger, else none. */}}
{{- define "zerokl.otlpEndpoint" -}}
{{- if .Values.tracing.otlpEndpoint -}}
{{- .Values.tracing.otlpEndpoint -}}
{{- else if .Values.tracing.jaeger.enabled -}}
{{- printf "http://%s-jaeger:4317" (include "zerokl.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "zerokl.authSecretName" -}}
{{- default (printf "%s-auth" (include "zerokl.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "zerokl.minioSecretName" -}}
{{- default (printf "%s-minio" (include "zerokl.fullname" .)) .Values.minio.existingSecret -}}
{{- end -}}

{{/* Pod labels: the selector labels plus the numerics version (blue/green selection keys on it). */}}
{{- define "zerokl.podLabels" -}}
{{ include "zerokl.labels" . }}
zerokl.dev/numerics-version: {{ .root.Values.numerics.version | quote }}
{{- with .root.Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod annotations: config checksum (a changed ConfigMap rolls the pods) and Prometheus scraping. */}}
{{- define "zerokl.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- if .root.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .root.Values.ports.metrics | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .root.Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Environment every zerokl container gets: tracing, auth, a writable HOME on the tmp volume. */}}
{{- define "zerokl.env" -}}
- name: PYTHONUNBUFFERED
  value: "1"
- name: HOME
  value: /tmp
- name: ZEROKL_REPLICA_ID
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
{{- $otlp := include "zerokl.otlpEndpoint" .root }}
{{- if $otlp }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $otlp | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ hasPrefix "http://" $otlp | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .root.Values.tracing.samplerRatio | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,service.namespace=%s,zerokl.numerics_version=%s" .root.Release.Namespace .root.Release.Name .root.Values.numerics.version | quote }}
{{- end }}
{{- if .root.Values.auth.enabled }}
{{- $secret := include "zerokl.authSecretName" .root }}
{{- range $env, $role := dict "ZEROKL_AUTH_TOKEN" "client" "ZEROKL_PEER_TOKEN" "peer" "ZEROKL_OPERATOR_TOKEN" "operator" }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef: {name: {{ $secret | quote }}, key: {{ index $.root.Values.auth.keys $role | quote }}}
{{- end }}
{{- end }}
{{- end -}}

{{/* gRPC-native probes on grpc.health.v1 (kubelet >= 1.27). A weight swap reports NOT_SERVING
     for a moment: readiness drops the pod from its Service, liveness tolerates it. With
     "fleetHealth" (the scheduler, whose health reports whether the *fleet* can serve: no decode
     replica or a mixed fleet is NOT_SERVING) startup and liveness only check that the process
     accepts connections: restarting it would not bring a replica back. */}}
{{- define "zerokl.probes" -}}
{{- $check := ternary (dict "tcpSocket" (dict "port" .port)) (dict "grpc" (dict "port" .port)) (default false .fleetHealth) -}}
startupProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
  failureThreshold: 120
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* Resources with GPUs: `gpus`, or the tensor-parallel degree when that is larger. */}}
{{- define "zerokl.resources" -}}
{{- $res := deepCopy (default dict .spec.resources) -}}
{{- $gpus := max (int .spec.gpus) (int (default 1 .spec.tensorParallel)) -}}
{{- if or (gt (int .spec.gpus) 0) (gt (int (default 1 .spec.tensorParallel)) 1) -}}
{{- $limits := merge (dict "nvidia.com/gpu" $gpus) (default dict $res.limits) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* torch.distributed environment for tensor parallelism inside one pod (see docs/operator.md). */}}
{{- define "zerokl.distributedEnv" -}}
{{- $tp := int (default 1 .tensorParallel) -}}
- name: ZEROKL_TENSOR_PARALLEL
  value: {{ $tp | quote }}
- name: WORLD_SIZE
  value: {{ $tp | quote }}
- name: LOCAL_WORLD_SIZE
  value: {{ $tp | quote }}
- name: MASTER_ADDR
  value: localhost
- name: MASTER_PORT
  value: "29500"
{{- end -}}

{{- define "zerokl.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* Only the scheduler talks to the Kubernetes API; other pods get no token at all. */}}
{{- define "zerokl.podSpecCommon" -}}
{{- if .kubeApi }}
serviceAccountName: {{ include "zerokl.serviceAccountName" .root }}
{{- else }}
automountServiceAccountToken: false
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* NetworkPolicy peer: the release's pods of one component. */}}
{{- define "zerokl.peer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "zerokl.name" .root }}
      app.kubernetes.io/instance: {{ .root.Release.Name }}
      app.kubernetes.io/component: {{ .component }}
{{- end -}}
{{/* Egress every zerokl pod needs: DNS and the OTLP endpoint. */}}
{{- define "zerokl.egressCommon" -}}
# DNS
- to:
    - namespaceSelector: {}
  ports:
    - {port: 53, protocol: UDP}
    - {port: 53, protocol: TCP}
{{- if .Values.tracing.jaeger.enabled }}
# spans to the chart's Jaeger
- to:
    {{- include "zerokl.peer" (dict "root" . "component" "jaeger") | nindent 4 }}
  ports:
    - {port: 4317, protocol: TCP}
{{- end }}
{{- if .Values.tracing.otlpEndpoint }}
# spans to the configured OTLP endpoint
{{- toYaml .Values.networkPolicy.otlpEgress | nindent 0 }}
{{- end }}
{{- end -}}
