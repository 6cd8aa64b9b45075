{{/*
The learner's pod template, shared by its StatefulSet and its LeaderWorkerSet.

One torchrun job spans learner.nodes pods, learner.gpus ranks each (learner.nprocPerNode
without GPUs):
- nodes 1: `torchrun --standalone` in the one pod, as on a single machine.
- nodes N > 1 (StatefulSet): every pod runs `torchrun --nnodes N --rdzv_backend c10d
  --rdzv_endpoint <pod 0>.<headless Service>:<rdzvPort> --rdzv_id <run id>`. Under c10d
  torchrun orders the pods by their node address (it ignores --node_rank), so each pod
  gives its stable DNS name as --local_addr: pod 0's name sorts first and pod 0 hosts
  global rank 0 (metrics, Redis, publishing, checkpoints) after every restart.
- LeaderWorkerSet: the same, the rendezvous at $(LWS_LEADER_ADDRESS); the pods' addresses
  are the names the operator gives them, whose order need not put the leader first: global
  rank 0 runs in one fixed pod of the group, and the checkpoints are on a claim all mount.
Global rank 0 serves /metrics and /health on the metrics port; the first rank of every other
pod serves /health there (an empty /metrics), so every pod answers its probes.
Call with (dict "root" $ "name" <workload name> "lws" <bool>)
*/}}
{{- define "ludic.learner.args" -}}
{{- $root := .root -}}
{{- $v := $root.Values.learner -}}
{{- $nproc := ternary (int $v.gpus) (int $v.nprocPerNode) (gt (int $v.gpus) 0) -}}
{{- if .lws }}
- --nnodes={{ $v.nodes }}
- --nproc_per_node={{ $nproc }}
- --rdzv_backend=c10d
- --rdzv_endpoint=$(LWS_LEADER_ADDRESS):{{ $v.rdzvPort }}
- --rdzv_id={{ include "ludic.runId" $root }}
{{- else if gt (int $v.nodes) 1 }}
- --nnodes={{ $v.nodes }}
- --nproc_per_node={{ $nproc }}
- --rdzv_backend=c10d
- --rdzv_endpoint={{ printf "%s-0.%s.%s.svc.cluster.local:%d" .name .name $root.Release.Namespace (int $v.rdzvPort) }}
- --rdzv_id={{ include "ludic.runId" $root }}
- --local_addr={{ printf "$(POD_NAME).%s.%s.svc.cluster.local" .name $root.Release.Namespace }}
{{- else }}
- --standalone
- --nproc_per_node={{ $nproc }}
{{- end }}
- -m
- services.cli
- learner
{{- end -}}

{{- define "ludic.learner.multiNode" -}}
{{- if or .Values.learner.leaderWorkerSet.enabled (gt (int .Values.learner.nodes) 1) -}}true{{- end -}}
{{- end -}}

{{- define "ludic.learner.podTemplate" -}}
{{- $root := .root -}}
{{- $v := $root.Values.learner -}}
{{- $ctx := dict "root" $root "component" "learner" -}}
{{- $multi := include "ludic.learner.multiNode" $root -}}
metadata:
  labels:
    {{- include "ludic.selectorLabels" $ctx | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- include "ludic.podAnnotations" (dict "root" $root "values" $v "port" $v.containerPorts.metrics "path" "/metrics") | nindent 4 }}
spec:
  serviceAccountName: {{ include "ludic.serviceAccountName" $root }}
  automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
  {{- include "ludic.imagePullSecrets" $root | nindent 2 }}
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- include "ludic.podScheduling" $v | nindent 2 }}
  {{- include "ludic.modelInit" (dict "root" $root "values" $v) | nindent 2 }}
  containers:
    - name: learner
      image: {{ include "ludic.image" (dict "root" $root "image" $v.image) }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      # FSDP2 across the GPUs of this pod and, with learner.nodes > 1, of the other pods
      command: ["torchrun"]
      args:
        {{- include "ludic.learner.args" . | nindent 8 }}
      ports:
        - name: metrics
          containerPort: {{ $v.containerPorts.metrics }}
          protocol: TCP
        {{- if $multi }}
        - name: rdzv
          containerPort: {{ $v.rdzvPort }}
          protocol: TCP
        {{- end }}
      env:
        {{- if $multi }}
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- end }}
        {{- include "ludic.env.redis" $root | nindent 8 }}
        {{- include "ludic.env.authToken" $root | nindent 8 }}
        {{- include "ludic.env.inferenceUrls" $root | nindent 8 }}
        {{- include "ludic.env.config" $root | nindent 8 }}
        # the starting policy: the /models/<name> inference serves (model-init or the claim)
        - name: LUDIC_MODEL_DIR
          value: {{ printf "/models/%s" $root.Values.inference.model.name | quote }}
        # checkpoints on the checkpoints volume; after a restart the learner resumes from
        # the newest one and its stream cursor (rank 0 reads it and broadcasts it)
        - name: LUDIC_OUTPUT_DIR
          value: {{ $v.persistence.mountPath | quote }}
        - name: LUDIC_RESUME
          value: "true"
        - name: LUDIC_CHECKPOINT_EVERY
          value: {{ $v.checkpointEvery | toString | quote }}
        - name: LUDIC_NUM_STEPS
          value: {{ $v.numSteps | toString | quote }}
        {{- include "ludic.env.ompNumThreads" $v | nindent 8 }}
        {{- include "ludic.env.extra" $v | nindent 8 }}
      {{- include "ludic.httpProbes" (dict "values" $v "path" "/health" "port" "metrics") | nindent 6 }}
      resources:
        {{- include "ludic.resources" (dict "resources" $v.resources "gpus" $v.gpus) | nindent 8 }}
      {{- with $v.containerSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: checkpoints
          mountPath: {{ $v.persistence.mountPath }}
        - name: config
          mountPath: /etc/ludic
          readOnly: true
        - name: models
          mountPath: /models
          readOnly: true
        - name: shm
          mountPath: /dev/shm
        {{- include "ludic.redisUrlMount" . | nindent 8 }}
        {{- include "ludic.scratchMounts" . | nindent 8 }}
  volumes:
    {{- include "ludic.redisUrlVolume" (dict "root" $root "role" "learner") | nindent 4 }}
    - name: config
      configMap:
        name: {{ include "ludic.configMapName" $root }}
    {{- include "ludic.modelVolume" (dict "root" $root "values" $v) | nindent 4 }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shmSize }}
    {{- include "ludic.scratchVolumes" $v | nindent 4 }}
    {{- if not $v.persistence.enabled }}
    - name: checkpoints
      emptyDir: {}
    {{- else if $v.persistence.existingClaim }}
    - name: checkpoints
      persistentVolumeClaim:
        claimName: {{ $v.persistence.existingClaim }}
    {{- end }}
{{- end -}}
