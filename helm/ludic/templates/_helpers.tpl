{{/* vim: set filetype=mustache: */}}

{{- define "ludic.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ludic.fullname" -}}
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

{{/* Name of a component's resources: <fullname>-<component>. Call with (dict "root" $ "component" "actor") */}}
{{- define "ludic.componentName" -}}
{{- printf "%s-%s" (include "ludic.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ludic.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "ludic.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ludic
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of a component. Call with (dict "root" $ "component" "actor") */}}
{{- define "ludic.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ludic.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* All labels of a component's resources */}}
{{- define "ludic.componentLabels" -}}
{{ include "ludic.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ludic.annotations" -}}
{{- with .Values.commonAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Image reference. Call with (dict "root" $ "image" .Values.actor.image) */}}
{{- define "ludic.image" -}}
{{- $registry := default .image.registry .root.Values.global.imageRegistry -}}
{{- $ref := printf "%s/%s" $registry .image.repository -}}
{{- if not $registry -}}{{- $ref = .image.repository -}}{{- end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $ref .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $ref (.image.tag | default .root.Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}

{{- define "ludic.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "ludic.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ludic.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ludic.runId" -}}
{{- default .Release.Name .Values.runId -}}
{{- end -}}

{{/* ---------- secrets ---------- */}}

{{- define "ludic.authSecretName" -}}
{{- default (printf "%s-auth" (include "ludic.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "ludic.authSecretKey" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecretTokenKey }}{{- else -}}auth-token{{- end -}}
{{- end -}}

{{- define "ludic.apiKeySecretKey" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecretApiKeyKey }}{{- else -}}api-key{{- end -}}
{{- end -}}

{{/* The Redis Secret given (redis.auth.existingSecret, or externalRedis.existingSecret), or "" */}}
{{- define "ludic.redisExistingSecret" -}}
{{- ternary .Values.redis.auth.existingSecret .Values.externalRedis.existingSecret .Values.redis.enabled -}}
{{- end -}}

{{/* The Redis Secret: per role `<role>-url` (what its pods mount), and for the bundled Redis
     `<role>-password`, `admin-*` and `users.acl`; the chart's own unless one is given */}}
{{- define "ludic.redisSecretName" -}}
{{- default (printf "%s-redis" (include "ludic.fullname" .)) (include "ludic.redisExistingSecret" .) -}}
{{- end -}}

{{/* A value kept across upgrades: the given one, else the one already in the cluster, else random.
     Call with (dict "root" $ "secret" name "key" key "value" given) */}}
{{- define "ludic.secretValue" -}}
{{- if .value -}}
{{- .value | b64enc -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .secret -}}
{{- if and $existing (hasKey $existing.data .key) -}}
{{- index $existing.data .key -}}
{{- else -}}
{{- randAlphaNum 40 | b64enc -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* ---------- Redis connection ---------- */}}

{{- define "ludic.redisHost" -}}
{{- printf "%s-redis.%s.svc.cluster.local" (include "ludic.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* Parsed external URL: scheme, host (host:port), path (/db) */}}
{{- define "ludic.externalRedisParts" -}}
{{- $u := urlParse .Values.externalRedis.url -}}
{{- if not (has $u.scheme (list "redis" "rediss")) -}}
{{- fail (printf "externalRedis.url %q must start with redis:// or rediss://" .Values.externalRedis.url) -}}
{{- end -}}
{{- if $u.userinfo -}}
{{- fail "externalRedis.url must not carry credentials; put the password in externalRedis.existingSecret" -}}
{{- end -}}
{{- toJson $u -}}
{{- end -}}

{{/* ---------- Redis users (services/common/redis_acl.py: the one definition; the test
     tests/deploy/test_deploy_redis_users.py holds these templates to it) ---------- */}}

{{/* the roles, each a user `ludic-<role>` (ROLES) */}}
{{- define "ludic.redisRoles" -}}actor credit learner feeder eval{{- end -}}

{{/* the run's keys (key_pattern; runId's schema admits no glob character to escape) */}}
{{- define "ludic.redisKeyPattern" -}}
{{- printf "ludic:{%s}:*" (include "ludic.runId" .) -}}
{{- end -}}

{{/* a role's rules (role_rules). Call with (dict "root" $ "role" "actor") */}}
{{- define "ludic.redisRoleRules" -}}
{{- $base := "-@all +@connection +@read +@write +@stream +@hash +@string +@list +@set +@sortedset +@keyspace +@scripting +@transaction +@blocking -@admin -@dangerous -script|flush -script|kill" -}}
{{- $extra := get (dict "feeder" "+info") .role -}}
{{- trim (printf "resetkeys ~%s resetchannels %s %s" (include "ludic.redisKeyPattern" .root) $base $extra) -}}
{{- end -}}

{{/* redis-server's ACL file (RunUsers.acl_config(hashed=True)): the default user off but with
     every permission (redis-server replays its append-only file as that user), the admin,
     one user per role; SHA-256 hashes, no password. Call with (dict "root" $ "passwords" map) */}}
{{- define "ludic.redisAclFile" -}}
user default off resetpass ~* &* +@all
user ludic-admin on #{{ sha256sum .passwords.admin }} ~* &* +@all
{{ range $role := splitList " " (include "ludic.redisRoles" .root) -}}
user ludic-{{ $role }} on #{{ sha256sum (get $.passwords $role) }} {{ include "ludic.redisRoleRules" (dict "root" $.root "role" $role) }}
{{ end -}}
{{- end -}}

{{/* A role's Redis URL (a Secret's `<role>-url`). Bundled: its own user; external: the shared
     externalRedis.password, or none (allowNoAuth). Call with (dict "root" $ "role" r "password" p) */}}
{{- define "ludic.redisRoleUrl" -}}
{{- if .root.Values.redis.enabled -}}
{{- printf "redis://ludic-%s:%s@%s:%d/0" .role .password (include "ludic.redisHost" .root) (int .root.Values.redis.containerPorts.redis) -}}
{{- else -}}
{{- $u := include "ludic.externalRedisParts" .root | fromJson -}}
{{- $auth := ternary (printf ":%s@" .password) "" (ne .password "") -}}
{{- printf "%s://%s%s%s" $u.scheme $auth $u.host (default "/0" $u.path) -}}
{{- end -}}
{{- end -}}

{{/* host:port for KEDA */}}
{{- define "ludic.redisAddress" -}}
{{- if .Values.redis.enabled -}}
{{- printf "%s:%d" (include "ludic.redisHost" .) (int .Values.redis.containerPorts.redis) -}}
{{- else -}}
{{- $u := include "ludic.externalRedisParts" . | fromJson -}}
{{- if contains ":" $u.host -}}{{ $u.host }}{{- else -}}{{ printf "%s:6379" $u.host }}{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ludic.redisTLS" -}}
{{- if .Values.redis.enabled -}}false{{- else -}}{{- $u := include "ludic.externalRedisParts" . | fromJson -}}{{ eq $u.scheme "rediss" }}{{- end -}}
{{- end -}}

{{- define "ludic.redisDb" -}}
{{- if .Values.redis.enabled -}}0{{- else -}}{{- $u := include "ludic.externalRedisParts" . | fromJson -}}{{ default "0" (trimPrefix "/" $u.path) }}{{- end -}}
{{- end -}}

{{/* ---------- env blocks (secrets only by reference) ---------- */}}

{{/* the URL (its password) is a file from the Redis Secret: ludic.redisUrlVolume */}}
{{- define "ludic.env.redis" -}}
- name: LUDIC_REDIS_URL_FILE
  value: /run/secrets/ludic/redis-url
- name: LUDIC_RUN_ID
  value: {{ include "ludic.runId" . | quote }}
{{- end -}}

{{- define "ludic.redisUrlMount" -}}
- name: redis-url
  mountPath: /run/secrets/ludic
  readOnly: true
{{- end -}}

{{/* the role's own URL only, readable by the pod's fsGroup. Call with (dict "root" $ "role" r) */}}
{{- define "ludic.redisUrlVolume" -}}
- name: redis-url
  secret:
    secretName: {{ include "ludic.redisSecretName" .root }}
    defaultMode: 0440
    items:
      - key: {{ printf "%s-url" .role }}
        path: redis-url
{{- end -}}

{{- define "ludic.env.authToken" -}}
- name: LUDIC_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "ludic.authSecretName" . }}
      key: {{ include "ludic.authSecretKey" . }}
{{- end -}}

{{/* the generation routes' token: inference requires it, actors and eval send it */}}
{{- define "ludic.env.apiKey" -}}
- name: LUDIC_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "ludic.authSecretName" . }}
      key: {{ include "ludic.apiKeySecretKey" . }}
{{- end -}}

{{/* Inference replicas: one headless-Service name; clients expand it to every pod address */}}
{{- define "ludic.env.inferenceUrls" -}}
- name: LUDIC_INFERENCE_URLS
  value: {{ printf "http://%s.%s.svc.cluster.local:%d" (include "ludic.componentName" (dict "root" . "component" "inference")) .Release.Namespace (int .Values.inference.containerPorts.http) | quote }}
{{- end -}}

{{- define "ludic.env.config" -}}
- name: LUDIC_CONFIG
  value: /etc/ludic/config.yaml
{{- end -}}

{{/* OMP_NUM_THREADS from the component's ompNumThreads, as compose.yaml sets it; <component>.env
     overrides it. Components without ompNumThreads (inference, feeder) render nothing.
     Call with the component values */}}
{{- define "ludic.env.ompNumThreads" -}}
{{- if and (hasKey . "ompNumThreads") (not (hasKey (default dict .env) "OMP_NUM_THREADS")) -}}
- name: OMP_NUM_THREADS
  value: {{ .ompNumThreads | toString | quote }}
{{- end -}}
{{- end -}}

{{/* User env map + extraEnvVars. Call with the component values */}}
{{- define "ludic.env.extra" -}}
{{- range $k, $v := .env }}
- name: {{ $k }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- with .extraEnvVars }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* ---------- pods ---------- */}}

{{/* One probe. Call with (dict "probe" .Values.x.livenessProbe "handler" (dict ...)) */}}
{{- define "ludic.probe" -}}
{{- $p := omit .probe "enabled" -}}
{{- toYaml (merge $p .handler) -}}
{{- end -}}

{{/* liveness/readiness/startup probes as HTTP GET. Call with (dict "values" .Values.actor "path" "/metrics" "port" "metrics") */}}
{{- define "ludic.httpProbes" -}}
{{- $handler := dict "httpGet" (dict "path" .path "port" .port) -}}
{{- if .values.livenessProbe.enabled }}
livenessProbe:
  {{- include "ludic.probe" (dict "probe" .values.livenessProbe "handler" $handler) | nindent 2 }}
{{- end }}
{{- if .values.readinessProbe.enabled }}
readinessProbe:
  {{- include "ludic.probe" (dict "probe" .values.readinessProbe "handler" $handler) | nindent 2 }}
{{- end }}
{{- if .values.startupProbe.enabled }}
startupProbe:
  {{- include "ludic.probe" (dict "probe" .values.startupProbe "handler" $handler) | nindent 2 }}
{{- end }}
{{- end -}}

{{/* prometheus.io annotations + checksums + user annotations. Call with (dict "root" $ "values" .Values.actor "port" 9101 "path" "/metrics") */}}
{{- define "ludic.podAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: {{ .path | quote }}
{{- end }}
checksum/config: {{ toYaml .root.Values.config | sha256sum }}
{{- /* the secrets' inputs, not their generated values (lookup keeps those across upgrades):
       a new token, api key or password given in values rolls every pod that reads it;
       auth.rotation / redis.auth.rotation roll them for a rotated existingSecret */}}
checksum/secrets: {{ list .root.Values.auth .root.Values.redis.auth .root.Values.externalRedis | toJson | sha256sum }}
{{- with .values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* scheduling + security. Call with the component values */}}
{{- define "ludic.podScheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* resources with the nvidia.com/gpu limit added. Call with (dict "resources" .resources "gpus" .gpus) */}}
{{- define "ludic.resources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := deepCopy (get $res "limits" | default dict) -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "ludic.configMapName" -}}
{{- default (printf "%s-config" (include "ludic.fullname" .)) .Values.existingConfigMap -}}
{{- end -}}

{{/* PodDisruptionBudget. Call with (dict "root" $ "component" "actor" "values" .Values.actor) */}}
{{- define "ludic.pdb" -}}
{{- if .values.pdb.create }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "ludic.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "ludic.componentLabels" . | nindent 4 }}
spec:
  {{- if not (eq (toString .values.pdb.minAvailable) "") }}
  minAvailable: {{ .values.pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .values.pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "ludic.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* Metrics Service for a component. Call with (dict "root" $ "component" "actor" "port" 9101 "portName" "metrics" "headless" false);
     optional "name" (default <fullname>-<component>) and "publishNotReady" (DNS names for
     pods before they are ready: the learner's pods rendezvous through them) */}}
{{- define "ludic.metricsService" -}}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ .name | default (include "ludic.componentName" .) }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "ludic.componentLabels" . | nindent 4 }}
spec:
  type: ClusterIP
  {{- if .headless }}
  clusterIP: None
  {{- end }}
  {{- if .publishNotReady }}
  publishNotReadyAddresses: true
  {{- end }}
  ports:
    - name: {{ .portName }}
      port: {{ .port }}
      targetPort: {{ .portName }}
      protocol: TCP
  selector:
    {{- include "ludic.selectorLabels" . | nindent 4 }}
{{- end -}}

{{/* ---------- scratch of a read-only root filesystem ---------- */}}

{{/* /tmp and the home directory (caches, vLLM's config), writable on a read-only root */}}
{{- define "ludic.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/ludic
{{- end -}}

{{/* their emptyDirs; call with the component's values */}}
{{- define "ludic.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .tmpSizeLimit }}
- name: home
  emptyDir:
    sizeLimit: 512Mi
{{- end -}}

{{/* ---------- model volume (inference + learner) ---------- */}}

{{/* initContainers writing the demo model when no claim is given. Call with (dict "root" $ "values" <component values>) */}}
{{- define "ludic.modelInit" -}}
{{- $m := .root.Values.inference.model -}}
{{- if and (not $m.existingClaim) $m.init.enabled }}
initContainers:
  # `ludic model init` is deterministic (fixed seed): inference and learner build the same
  # version-0 weights without sharing a volume.
  - name: model-init
    image: {{ include "ludic.image" (dict "root" .root "image" .values.image) }}
    imagePullPolicy: {{ .values.image.pullPolicy }}
    args: ["model", "init", {{ printf "/models/%s" $m.name | quote }}, "--size", {{ $m.init.size | quote }}]
    resources:
      requests:
        cpu: 100m
        memory: 256Mi
      limits:
        memory: 2Gi
    {{- with .values.containerSecurityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: models
        mountPath: /models
      {{- include "ludic.scratchMounts" . | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "ludic.modelVolume" -}}
{{- $m := .root.Values.inference.model -}}
- name: models
{{- if $m.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $m.existingClaim }}
    readOnly: true
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}
