{{- define "chat-pipeline.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "chat-pipeline.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "chat-pipeline.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Integers go through int64 before quote: Helm reads numbers as floats, and quotes
86400000 as "8.64e+07", which no service parses. */}}
{{/* What a service reads: the cluster, its client file and the erasure window always;
the store, the KEK and a Kafka password only where it needs them, so that a component
holds no secret it does not use. Called with (dict "root" $ "db" bool "kek" bool "kafka" <a kafka block of
the values: username, passwordSecret>). */}}
{{- define "chat-pipeline.env" -}}
{{- $values := .root.Values -}}
{{- $kafka := .kafka | default $values.kafka -}}
- name: PIPELINE_KAFKA_BOOTSTRAP
  value: {{ $values.kafka.bootstrap | quote }}
- name: PIPELINE_KAFKA_CONFIG
  value: /etc/pipeline/kafka/{{ if .kafka }}memory{{ else }}client{{ end }}.properties
- name: PIPELINE_PARTITIONS
  value: {{ $values.kafka.partitions | int64 | quote }}
- name: PIPELINE_REPLICATION_FACTOR
  value: {{ $values.kafka.replicationFactor | int64 | quote }}
- name: PIPELINE_MIN_INSYNC_REPLICAS
  value: {{ $values.kafka.minInsyncReplicas | int64 | quote }}
- name: PIPELINE_STATE_DIR
  value: /tmp/pipeline
- name: PIPELINE_METRICS_HOST
  value: 0.0.0.0
{{- /* Every process, the setup job too: it makes chat.keys and chat.erasures with it,
and a process keeping erasures for less than the topics keep keys refuses to start. */}}
- name: PIPELINE_ERASURE_WINDOW_MS
  value: {{ $values.sealing.erasureWindowMs | int64 | quote }}
{{- if .db }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $values.postgres.urlSecret.name }}
      key: {{ $values.postgres.urlSecret.key }}
{{- end }}
{{- if .kek }}
- name: PIPELINE_KEK
  valueFrom:
    secretKeyRef:
      name: {{ $values.sealing.kekSecret.name }}
      key: {{ $values.sealing.kekSecret.key }}
{{- end }}
{{- if $kafka.passwordSecret.name }}
- name: PIPELINE_KAFKA_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $kafka.passwordSecret.name }}
      key: {{ $kafka.passwordSecret.key }}
{{- end }}
{{- end -}}

{{/* Every container's root is read-only: what it writes goes to /tmp, a volume. */}}
{{- define "chat-pipeline.mounts" -}}
- name: tmp
  mountPath: /tmp
- name: kafka-client
  mountPath: /etc/pipeline/kafka
  readOnly: true
{{- if .Values.kafka.caSecret.name }}
- name: kafka-ca
  mountPath: /etc/pipeline/kafka-ca
  readOnly: true
{{- end }}
{{- if .Values.postgres.caSecret.name }}
- name: postgres-ca
  mountPath: /etc/pipeline/postgres-ca
  readOnly: true
{{- end }}
{{- end -}}

{{- define "chat-pipeline.volumes" -}}
- name: tmp
  emptyDir: {}
- name: kafka-client
  configMap:
    name: {{ include "chat-pipeline.fullname" . }}-kafka-client
{{- if .Values.kafka.caSecret.name }}
- name: kafka-ca
  secret:
    secretName: {{ .Values.kafka.caSecret.name }}
    items:
      - key: {{ .Values.kafka.caSecret.key }}
        path: ca.crt
{{- end }}
{{- if .Values.postgres.caSecret.name }}
- name: postgres-ca
  secret:
    secretName: {{ .Values.postgres.caSecret.name }}
    defaultMode: 0400
{{- end }}
{{- end -}}


{{/* Non-empty when some worker scales with KEDA. */}}
{{- define "chat-pipeline.keda" -}}
{{- range .Values.workers }}{{ if .keda.enabled }}yes{{ end }}{{ end -}}
{{- end -}}

{{/* What the setup Job needs exists before it: made as a hook of lower weight. */}}
{{- define "chat-pipeline.before-setup" -}}
helm.sh/hook: pre-install,pre-upgrade
helm.sh/hook-weight: "0"
helm.sh/hook-delete-policy: before-hook-creation
{{- end -}}

{{/* The Host names a gateway answers: its Service's names in the cluster, and those the
values add (the public names an ingress sends); never any name ("*") unless asked. */}}
{{- define "chat-pipeline.gateway-hosts" -}}
{{- $service := printf "%s-gateway" (include "chat-pipeline.fullname" .) -}}
{{- $namespace := .Release.Namespace -}}
{{- $hosts := list $service (printf "%s.%s" $service $namespace) (printf "%s.%s.svc" $service $namespace) (printf "%s.%s.svc.cluster.local" $service $namespace) -}}
{{- join "," (concat $hosts .Values.gateway.allowedHosts) -}}
{{- end -}}

{{/* A value of the values' env maps, quoted as the service reads it: a whole number
as digits (not Helm's float, "8.64e+07"), anything else as written. */}}
{{- define "chat-pipeline.scalar" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}
{{- int64 . | toString | quote -}}
{{- else -}}
{{- toString . | quote -}}
{{- end -}}
{{- end -}}
