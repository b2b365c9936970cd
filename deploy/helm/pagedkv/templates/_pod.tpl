{{/*
The server's pod template (spec.template of its Deployment or StatefulSet, indented for it). The
disk tier's volume is mounted in both; it is a pod volume only for an existing claim, otherwise it
comes from the StatefulSet's volumeClaimTemplate.
*/}}
{{- define "pagedkv.podTemplate" }}
{{- $disk := .Values.kvDiskTier }}
{{- $cache := .Values.modelCache }}
  template:
    metadata:
      labels:
        {{- include "pagedkv.selectorLabels" . | nindent 8 }}
        {{- with .Values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- $newSecret := and .Values.apiKey.value (not .Values.apiKey.existingSecret) }}
      {{- if or $newSecret .Values.podAnnotations }}
      annotations:
        {{- if $newSecret }}
        # A new key rolls the pods (the key is read at start).
        checksum/api-key: {{ .Values.apiKey.value | sha256sum | trunc 16 }}
        {{- end }}
        {{- with .Values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
    spec:
      {{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      # SIGTERM drains for up to drainTimeout seconds; the kubelet waits a little longer.
      terminationGracePeriodSeconds: {{ add (int .Values.server.drainTimeout) 15 }}
      securityContext:
        {{- toYaml .Values.podSecurityContext | nindent 8 }}
      {{- if $cache.enabled }}
      initContainers:
        # The image's cache (native kernels, the default model's converted copy) into the model
        # cache, keeping what is there (a model converted by an earlier start stays).
        - name: seed-model-cache
          image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          securityContext:
            {{- toYaml .Values.securityContext | nindent 12 }}
          # (Python, not `cp -n`, whose exit status for a skipped file differs between coreutils versions.)
          command:
            - python
            - -c
            - "import os, shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True, copy_function=lambda s, d: os.path.exists(d) or shutil.copy2(s, d))"
            - {{ .Values.image.cacheDir | quote }}
            - {{ $cache.dir | quote }}
          volumeMounts:
            - name: model-cache
              mountPath: {{ $cache.dir }}
      {{- end }}
      containers:
        - name: pagedkv
          image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          securityContext:
            {{- toYaml .Values.securityContext | nindent 12 }}
          # The image's entrypoint runs `pagedkv serve [$MODEL] --host 0.0.0.0 --port $PORT ARGS`.
          args:
            - --log-level
            - {{ .Values.server.logLevel | quote }}
            - --drain-timeout
            - {{ .Values.server.drainTimeout | quote }}
            {{- if not (kindIs "invalid" .Values.server.maxQueue) }}
            - --max-queue
            - {{ .Values.server.maxQueue | quote }}
            {{- end }}
            {{- range .Values.model.servedModelNames }}
            - --served-model-name
            - {{ . | quote }}
            {{- end }}
            - --kv-cache-memory
            - {{ .Values.engine.kvCacheMemory | quote }}
            - --max-num-seqs
            - {{ .Values.engine.maxNumSeqs | quote }}
            - --max-num-batched-tokens
            - {{ .Values.engine.maxNumBatchedTokens | quote }}
            - --block-size
            - {{ .Values.engine.blockSize | quote }}
            - --kv-cache-dtype
            - {{ .Values.engine.kvCacheDtype | quote }}
            {{- with .Values.engine.threads }}
            - --threads
            - {{ . | quote }}
            {{- end }}
            {{- if $disk.enabled }}
            - --kv-offloading-size
            - {{ $disk.hostTierSize | quote }}
            - --kv-offload-dir
            - {{ $disk.dir | quote }}
            - --kv-offload-disk-size
            - {{ $disk.size | quote }}
            {{- end }}
            {{- if .Values.kvRemoteTier.enabled }}
            # (expanded by the kubelet from the env below: the URL stays out of the pod spec)
            - --kv-remote-url
            - $(KV_REMOTE_URL)
            - --kv-remote-key-prefix
            - {{ .Values.kvRemoteTier.keyPrefix | quote }}
            {{- end }}
            {{- range .Values.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            - name: PORT
              value: {{ .Values.server.port | quote }}
            - name: MODEL
              value: {{ .Values.model.path | quote }}
            {{- if $cache.enabled }}
            - name: PAGEDKV_CACHE_DIR
              value: {{ $cache.dir | quote }}
            - name: HF_HUB_CACHE
              value: {{ printf "%s/hub" $cache.dir | quote }}
            {{- end }}
            {{- with .Values.kvRemoteTier }}
            {{- if .enabled }}
            - name: KV_REMOTE_URL
              {{- if or .url .existingSecret }}
              valueFrom:
                secretKeyRef:
                  name: {{ include "pagedkv.kvRemoteSecretName" $ }}
                  key: {{ .secretKey }}
              {{- else }}
              value: {{ printf "redis://%s:%d/0" (include "pagedkv.redisName" $) (int .redis.port) | quote }}
              {{- end }}
            {{- end }}
            {{- end }}
            {{- if or .Values.apiKey.value .Values.apiKey.existingSecret }}
            - name: PAGEDKV_API_KEY
              valueFrom:
                secretKeyRef:
                  name: {{ include "pagedkv.secretName" . }}
                  key: {{ .Values.apiKey.secretKey }}
            {{- end }}
            {{- with .Values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ .Values.server.port }}
              protocol: TCP
          # /health: 200 while serving; 503 while draining after SIGTERM (readiness takes the pod out
          # of the Service) or once the engine has died (liveness restarts it).
          startupProbe:
            httpGet:
              path: /health
              port: http
            {{- toYaml .Values.probes.startup | nindent 12 }}
          readinessProbe:
            httpGet:
              path: /health
              port: http
            {{- toYaml .Values.probes.readiness | nindent 12 }}
          livenessProbe:
            httpGet:
              path: /health
              port: http
            {{- toYaml .Values.probes.liveness | nindent 12 }}
          resources:
            {{- toYaml .Values.resources | nindent 12 }}
          {{- if or $disk.enabled .Values.model.existingClaim $cache.enabled }}
          volumeMounts:
            {{- if $disk.enabled }}
            - name: kv-disk-tier
              mountPath: {{ $disk.dir }}
            {{- end }}
            {{- if $cache.enabled }}
            - name: model-cache
              mountPath: {{ $cache.dir }}
            {{- end }}
            {{- if .Values.model.existingClaim }}
            - name: models
              mountPath: {{ .Values.model.mountPath }}
              readOnly: true
            {{- end }}
          {{- end }}
      {{- $diskVolume := and $disk.enabled (not (include "pagedkv.kvClaimTemplate" .)) }}
      {{- $cacheVolume := and $cache.enabled (not (include "pagedkv.modelCacheClaimTemplate" .)) }}
      {{- if or $diskVolume .Values.model.existingClaim $cacheVolume }}
      volumes:
        {{- if $diskVolume }}
        # One existing claim (one replica); otherwise the StatefulSet's volumeClaimTemplate gives
        # each replica its own.
        - name: kv-disk-tier
          persistentVolumeClaim:
            claimName: {{ $disk.persistence.existingClaim }}
        {{- end }}
        {{- if .Values.model.existingClaim }}
        - name: models
          persistentVolumeClaim:
            claimName: {{ .Values.model.existingClaim }}
            readOnly: true
        {{- end }}
        {{- if $cacheVolume }}
        # One model-cache claim for the pods (otherwise the StatefulSet's template gives each its own).
        - name: model-cache
          persistentVolumeClaim:
            claimName: {{ include "pagedkv.modelCacheClaimName" . }}
        {{- end }}
      {{- end }}
      {{- with .Values.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
