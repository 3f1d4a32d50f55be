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

{{/* What every service reads: the cluster, its client file, the store. */}}
{{- define "chat-pipeline.env" -}}
- name: PIPELINE_KAFKA_BOOTSTRAP
  value: {{ .Values.kafka.bootstrap | quote }}
- name: PIPELINE_KAFKA_CONFIG
  value: /etc/pipeline/kafka/client.properties
- name: PIPELINE_PARTITIONS
  value: {{ .Values.kafka.partitions | quote }}
- name: PIPELINE_REPLICATION_FACTOR
  value: {{ .Values.kafka.replicationFactor | quote }}
- name: PIPELINE_MIN_INSYNC_REPLICAS
  value: {{ .Values.kafka.minInsyncReplicas | quote }}
- name: PIPELINE_STATE_DIR
  value: /tmp/pipeline
- name: PIPELINE_METRICS_HOST
  value: 0.0.0.0
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.postgres.urlSecret.name }}
      key: {{ .Values.postgres.urlSecret.key }}
- name: PIPELINE_KEK
  valueFrom:
    secretKeyRef:
      name: {{ .Values.sealing.kekSecret.name }}
      key: {{ .Values.sealing.kekSecret.key }}
- name: PIPELINE_ERASURE_WINDOW_MS
  value: {{ .Values.sealing.erasureWindowMs | quote }}
{{- if .Values.kafka.passwordSecret.name }}
- name: PIPELINE_KAFKA_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.passwordSecret.name }}
      key: {{ .Values.kafka.passwordSecret.key }}
{{- end }}
{{- end -}}

{{- define "chat-pipeline.mounts" -}}
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
