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

{{/*
The server runs as a StatefulSet ("true") when each replica gets its own disk-tier claim from a
volumeClaimTemplate (disk tier on, no existingClaim) or when the router needs the replicas' stable
DNS names; otherwise (disk tier off, or one existing claim) as a Deployment ("").
*/}}
{{- define "pagedkv.statefulSet" -}}
{{- $disk := .Values.kvDiskTier }}
{{- if or .Values.router.enabled (and $disk.enabled (not $disk.persistence.existingClaim)) }}true{{ end }}
{{- end }}

{{/* Each replica's own disk-tier claim comes from the StatefulSet's volumeClaimTemplate ("true"). */}}
{{- define "pagedkv.kvClaimTemplate" -}}
{{- $disk := .Values.kvDiskTier }}
{{- if and $disk.enabled (not $disk.persistence.existingClaim) }}true{{ end }}
{{- end }}

{{/* Each replica's own model-cache claim comes from the StatefulSet's volumeClaimTemplate ("true"). */}}
{{- define "pagedkv.modelCacheClaimTemplate" -}}
{{- $cache := .Values.modelCache }}
{{- if and $cache.enabled (not $cache.persistence.existingClaim) (include "pagedkv.statefulSet" .) }}true{{ end }}
{{- end }}
{{/* The one model-cache claim of a Deployment: the existing one, or the chart's. */}}
{{- define "pagedkv.modelCacheClaimName" -}}
{{- default (printf "%s-model-cache" (include "pagedkv.fullname" . | trunc 50 | trimSuffix "-")) .Values.modelCache.persistence.existingClaim }}
{{- end }}
{{/* The headless Service that gives the StatefulSet's pods their DNS names. */}}
{{- define "pagedkv.headlessName" -}}
{{- printf "%s-headless" (include "pagedkv.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{/* One URL per replica, through the headless Service's pod DNS names (the container's port). */}}
{{- define "pagedkv.workerURLs" -}}
{{- $name := include "pagedkv.fullname" . }}
{{- $host := printf "%s.%s.svc.%s" (include "pagedkv.headlessName" .) .Release.Namespace .Values.clusterDomain }}
{{- range $i := until (int .Values.replicaCount) }}
{{ printf "http://%s-%d.%s:%d" $name $i $host (int $.Values.server.port) }}
{{- end }}
{{- end }}

{{- define "pagedkv.routerName" -}}
{{- printf "%s-router" (include "pagedkv.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{/* The router's pods carry another app.kubernetes.io/name: the server's Service must not select them. */}}
{{- define "pagedkv.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-router" (include "pagedkv.name" .) }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{- define "pagedkv.routerLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pagedkv.routerSelectorLabels" . }}
app.kubernetes.io/part-of: {{ include "pagedkv.name" . }}
app.kubernetes.io/version: {{ .Values.router.image.tag | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The remote KV tier's own Redis server (kvRemoteTier.redis), its Service and pods. */}}
{{- define "pagedkv.redisName" -}}
{{- printf "%s-redis" (include "pagedkv.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "pagedkv.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-redis" (include "pagedkv.name" .) }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kv-remote-tier
{{- end }}

{{/* The Secret holding the remote tier's URL: the given one, or the chart's (from kvRemoteTier.url). */}}
{{- define "pagedkv.kvRemoteSecretName" -}}
{{- default (printf "%s-kv-remote" (include "pagedkv.fullname" . | trunc 53 | trimSuffix "-")) .Values.kvRemoteTier.existingSecret }}
{{- end }}

{{/* Whether the chart runs its own Redis for the remote tier. */}}
{{- define "pagedkv.ownRedis" -}}
{{- $t := .Values.kvRemoteTier }}
{{- if and $t.enabled $t.redis.enabled (not $t.url) (not $t.existingSecret) }}true{{ end }}
{{- end }}

{{/* Value checks shared by the server's Deployment and StatefulSet (exactly one of them renders). */}}
{{- define "pagedkv.checks" -}}
{{- $disk := .Values.kvDiskTier }}
{{- if and $disk.enabled $disk.persistence.existingClaim (gt (int .Values.replicaCount) 1) }}
{{- fail "kvDiskTier.persistence.existingClaim is one volume, which allows one replica: the disk tier's directory is locked by one server; set replicaCount: 1, or leave existingClaim empty to give each replica its own claim" }}
{{- end }}
{{- $cache := .Values.modelCache }}
{{- if and $cache.enabled (not $cache.persistence.existingClaim) (not (include "pagedkv.statefulSet" .)) (gt (int .Values.replicaCount) 1) (not (has "ReadWriteMany" $cache.persistence.accessModes)) }}
{{- fail "modelCache: the chart's one claim of a Deployment is mounted by every replica, which needs modelCache.persistence.accessModes [ReadWriteMany] (or an existingClaim that allows it); or set replicaCount: 1, or modelCache.enabled: false" }}
{{- end }}
{{- if and $disk.enabled (le (float64 $disk.hostTierSize) 0.0) }}
{{- fail "kvDiskTier.hostTierSize must be above 0: the disk tier sits below the host tier (--kv-offloading-size)" }}
{{- end }}
{{- $remote := .Values.kvRemoteTier }}
{{- if and $remote.enabled (not $remote.url) (not $remote.existingSecret) (not $remote.redis.enabled) }}
{{- fail "kvRemoteTier.enabled needs a server: kvRemoteTier.url, kvRemoteTier.existingSecret, or kvRemoteTier.redis.enabled (the chart's own)" }}
{{- end }}
{{- if and $remote.enabled $remote.url (not (regexMatch "^(redis|rediss|unix)://" $remote.url)) }}
{{- fail "kvRemoteTier.url must start with redis://, rediss:// (TLS) or unix://" }}
{{- end }}
{{- if .Values.router.enabled }}
{{- if lt (int .Values.replicaCount) 1 }}
{{- fail "router.enabled needs replicaCount of at least 1: the router's worker URLs are the replicas" }}
{{- end }}
{{- $policies := list "cache_aware" "round_robin" "power_of_two" "least_load" "prefix_hash" "consistent_hashing" "random" "manual" "passthrough" }}
{{- if not (has .Values.router.policy $policies) }}
{{- fail (printf "router.policy %q is not a policy of smg launch --policy: one of %s" (toString .Values.router.policy) (join ", " $policies)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The series of this release as Prometheus scrapes them through the ServiceMonitor. */}}
{{- define "pagedkv.selector" -}}
job="{{ include "pagedkv.fullname" . }}",namespace="{{ .Release.Namespace }}"
{{- end }}
