{{- define "pagedkv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedkv.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "pagedkv.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "pagedkv.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pagedkv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedkv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagedkv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pagedkv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "pagedkv.secretName" -}}
{{- default (include "pagedkv.fullname" .) .Values.apiKey.existingSecret }}
{{- end }}

{{- define "pagedkv.kvClaimName" -}}
{{- default (printf "%s-kv" (include "pagedkv.fullname" .)) .Values.kvDiskTier.persistence.existingClaim }}
{{- end }}

{{/* The series of this release as Prometheus scrapes them through the ServiceMonitor. */}}
{{- define "pagedkv.selector" -}}
job="{{ include "pagedkv.fullname" . }}",namespace="{{ .Release.Namespace }}"
{{- end }}
