{{/*
Deployment of a stateless ludic worker (actor, credit, feeder, eval): `ludic <component>` with
its metrics port, its role's Redis URL (a file from the Redis Secret), OMP_NUM_THREADS (when
the component sets ompNumThreads), and optionally the config file and the inference URLs.
Call with (dict "root" $ "component" "actor" "values" .Values.actor "replicas" true
           "withConfig" false "withInference" true "withAuth" false)
*/}}
{{- define "ludic.workerDeployment" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $ctx := dict "root" $root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "ludic.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "ludic.componentLabels" $ctx | nindent 4 }}
  {{- include "ludic.annotations" $root | nindent 2 }}
spec:
  {{- if .replicas }}
  replicas: {{ $v.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    type: RollingUpdate
  selector:
    matchLabels:
      {{- include "ludic.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "ludic.selectorLabels" $ctx | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- include "ludic.podAnnotations" (dict "root" $root "values" $v "port" $v.containerPorts.metrics "path" "/metrics") | nindent 8 }}
    spec:
      serviceAccountName: {{ include "ludic.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
      {{- include "ludic.imagePullSecrets" $root | nindent 6 }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- include "ludic.podScheduling" $v | nindent 6 }}
      containers:
        - name: {{ .component }}
          image: {{ include "ludic.image" (dict "root" $root "image" $v.image) }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          args: [{{ .component | quote }}]
          ports:
            - name: metrics
              containerPort: {{ $v.containerPorts.metrics }}
              protocol: TCP
          env:
            {{- include "ludic.env.redis" $root | nindent 12 }}
            {{- if .withInference }}
            {{- include "ludic.env.inferenceUrls" $root | nindent 12 }}
            {{- include "ludic.env.apiKey" $root | nindent 12 }}
            {{- end }}
            {{- if .withAuth }}
            {{- include "ludic.env.authToken" $root | nindent 12 }}
            {{- end }}
            {{- if .withConfig }}
            {{- include "ludic.env.config" $root | nindent 12 }}
            {{- end }}
            {{- include "ludic.env.ompNumThreads" $v | nindent 12 }}
            {{- include "ludic.env.extra" $v | nindent 12 }}
          {{- include "ludic.httpProbes" (dict "values" $v "path" "/health" "port" "metrics") | nindent 10 }}
          resources:
            {{- include "ludic.resources" (dict "resources" $v.resources "gpus" 0) | nindent 12 }}
          {{- with $v.containerSecurityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- if .withConfig }}
            - name: config
              mountPath: /etc/ludic
              readOnly: true
            {{- end }}
            {{- include "ludic.redisUrlMount" . | nindent 12 }}
            {{- include "ludic.scratchMounts" . | nindent 12 }}
      volumes:
        {{- include "ludic.redisUrlVolume" (dict "root" $root "role" .component) | nindent 8 }}
        {{- if .withConfig }}
        - name: config
          configMap:
            name: {{ include "ludic.configMapName" $root }}
        {{- end }}
        {{- include "ludic.scratchVolumes" $v | nindent 8 }}
{{- end -}}
