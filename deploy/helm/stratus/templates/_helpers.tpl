{{/*
Names. fullname is the release name (plus "-stratus" unless it already says stratus), so that
`helm install stratus` names objects as deploy/k8s does: stratus-router, stratus-cloud, ...
*/}}
{{- define "stratus.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<part>: call with (list $ "router"). */}}
{{- define "stratus.name" -}}
{{- printf "%s-%s" (include "stratus.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{/* A Service's fully qualified name, which clients dial and certificates carry: (list $ "cloud-headless"). */}}
{{- define "stratus.fqdn" -}}
{{- $ := index . 0 -}}
{{- printf "%s.%s.svc.%s" (include "stratus.name" .) $.Release.Namespace $.Values.clusterDomain -}}
{{- end -}}

{{/* Labels of every object of a component: (list $ "router"). */}}
{{- define "stratus.labels" -}}
{{ include "stratus.selectorLabels" . }}
app.kubernetes.io/component: {{ index . 1 }}
app.kubernetes.io/part-of: stratus
app.kubernetes.io/managed-by: {{ (index . 0).Release.Service }}
app.kubernetes.io/version: {{ (index . 0).Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" (index . 0).Chart.Name (index . 0).Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* What a component's Services, PDB and controllers select its pods by. */}}
{{- define "stratus.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stratus.name" . }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
{{- end -}}

{{- define "stratus.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Secret holding a role's tls.crt, tls.key and ca.crt: (list $ "router"). */}}
{{- define "stratus.tlsSecret" -}}
{{- $ := index . 0 -}}
{{- $role := index . 1 -}}
{{- if eq $.Values.tls.source "certManager" -}}
{{- printf "%s-tls" (include "stratus.name" .) -}}
{{- else -}}
{{- default (printf "%s-tls" (include "stratus.name" .)) (get $.Values.tls.secrets $role) -}}
{{- end -}}
{{- end -}}

{{/* Agents reach every router pod through the headless Service (dns:NAME:PORT). */}}
{{- define "stratus.routerAddress" -}}
{{- printf "dns:%s:8001" (include "stratus.fqdn" (list . "router-headless")) -}}
{{- end -}}

{{/* The site's store every router shares (--site-state): the chart's NATS server, or siteState.url. */}}
{{- define "stratus.siteStateAddress" -}}
{{- if .Values.siteState.nats.enabled -}}
{{- printf "tls://%s:4222" (include "stratus.fqdn" (list . "nats")) -}}
{{- else -}}
{{- .Values.siteState.url -}}
{{- end -}}
{{- end -}}

{{/* The names the NATS server's certificate carries: its Service's, short and fully qualified. */}}
{{- define "stratus.natsHosts" -}}
{{- $name := include "stratus.name" (list . "nats") -}}
{{- printf "%s %s.%s.svc %s" $name $name .Release.Namespace (include "stratus.fqdn" (list . "nats")) -}}
{{- end -}}

{{/* Routers spread their cloud link over every ready cloud pod (dns:/// and the headless Service). */}}
{{- define "stratus.cloudAddress" -}}
{{- printf "dns:///%s:8002" (include "stratus.fqdn" (list . "cloud-headless")) -}}
{{- end -}}

{{/* Where router pods run, and how many exist at most (the per-pod Services are made for each). */}}
{{- define "stratus.routerPods" -}}
{{- if .Values.router.autoscaling.enabled -}}
{{- .Values.router.autoscaling.maxReplicas -}}
{{- else -}}
{{- .Values.router.replicas -}}
{{- end -}}
{{- end -}}

{{/* The pod security context every Stratus pod runs with (the namespace's restricted policy fits it). */}}
{{- define "stratus.podSecurityContext" -}}
automountServiceAccountToken: false
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "stratus.containerSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* The TLS flags: each role's certificate, key and the fleet CA, from its Secret at /etc/stratus/tls. */}}
{{- define "stratus.tlsArgs" -}}
- --tls-cert
- /etc/stratus/tls/tls.crt
- --tls-key
- /etc/stratus/tls/tls.key
- --tls-ca
- /etc/stratus/tls/ca.crt
- --tls-trust-domain
- {{ .Values.tls.certManager.trustDomain | default "stratus" }}
{{- end -}}

{{/*
Probes: grpc.health.v1 over mutual TLS through stratus.probe (Kubernetes' grpc probes speak
plaintext only). Readiness asks "" (the server's readiness), liveness and startup "liveness".
Call with (dict "port" 8001 "readinessPeriod" 2 "readinessFailures" 1).
*/}}
{{- define "stratus.probe" -}}
exec:
  command: [/opt/stratus/bin/python, -m, stratus.probe, "127.0.0.1:{{ .port }}",{{ if .service }} --service, {{ .service }},{{ end }}
            --tls-cert, /etc/stratus/tls/tls.crt, --tls-key, /etc/stratus/tls/tls.key, --tls-ca, /etc/stratus/tls/ca.crt,
            --timeout-s, "2"]
{{- end -}}

{{- define "stratus.probes" -}}
startupProbe:
  {{- include "stratus.probe" (dict "port" .port "service" "liveness") | nindent 2 }}
  periodSeconds: 2
  timeoutSeconds: 3
  failureThreshold: 60
livenessProbe:
  {{- include "stratus.probe" (dict "port" .port "service" "liveness") | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 6
readinessProbe:
  {{- include "stratus.probe" (dict "port" .port "service" "") | nindent 2 }}
  periodSeconds: {{ .readinessPeriod }}
  timeoutSeconds: 3
  failureThreshold: {{ .readinessFailures }}
{{- end -}}

{{/* The TLS volume of a role: (list $ "router"). Root-owned, group fsGroup, unreadable to others. */}}
{{- define "stratus.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ include "stratus.tlsSecret" . }}
    defaultMode: 0440
{{- end -}}

{{/* A token or key Secret mounted as a file: (list "volume-name" "secret-name"). */}}
{{- define "stratus.secretVolume" -}}
- name: {{ index . 0 }}
  secret:
    secretName: {{ index . 1 }}
    defaultMode: 0440
{{- end -}}

{{/* The model repository: the image's own, or the volume models.volume names. */}}
{{- define "stratus.modelsVolume" -}}
{{- with .Values.models.volume }}
- name: models
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "stratus.modelsMount" -}}
{{- if .Values.models.volume }}
- name: models
  mountPath: /app/models
  readOnly: true
{{- end }}
{{- end -}}

{{/* Where a component's pods may run. */}}
{{- define "stratus.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Checks across values that the schema cannot state clearly; each fails the render with one line
saying what to set.
*/}}
{{- define "stratus.checkValues" -}}
{{- if and .Values.openai.enabled (not .Values.openai.apiKeySecret.name) -}}
{{- fail "openai.enabled needs openai.apiKeySecret.name: off loopback the OpenAI API requires a key (a Secret whose openai.apiKeySecret.key holds it)" -}}
{{- end -}}
{{- if eq .Values.tls.source "certManager" -}}
{{- $cm := .Values.tls.certManager -}}
{{- if and $cm.issuerRef.name $cm.caSecretName -}}
{{- fail "tls.certManager: give issuerRef.name or caSecretName, not both" -}}
{{- end -}}
{{- if not (or $cm.issuerRef.name $cm.caSecretName) -}}
{{- fail "tls.source certManager needs tls.certManager.issuerRef.name (an Issuer or ClusterIssuer that puts the fleet CA in ca.crt) or tls.certManager.caSecretName (a Secret with the fleet CA's tls.crt and tls.key)" -}}
{{- end -}}
{{- end -}}
{{- $a := .Values.router.autoscaling -}}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- fail (printf "router.autoscaling.minReplicas (%d) is above maxReplicas (%d)" (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- $fewest := ternary $a.minReplicas .Values.router.replicas $a.enabled -}}
{{- if ge (int .Values.router.podDisruptionBudget.minAvailable) (int $fewest) -}}
{{- fail (printf "router.podDisruptionBudget.minAvailable (%d) must be below the fewest routers (%d), or no node could ever be drained" (int .Values.router.podDisruptionBudget.minAvailable) (int $fewest)) -}}
{{- end -}}
{{- $site := .Values.siteState -}}
{{- if and $site.nats.enabled $site.url -}}
{{- fail "siteState: give siteState.nats.enabled (the chart's NATS server) or siteState.url (yours), not both" -}}
{{- end -}}
{{- if not (or $site.nats.enabled $site.url) -}}
{{- fail "siteState: the routers of a site share one store: set siteState.nats.enabled=true, or siteState.url to your NATS server (tls://HOST:PORT)" -}}
{{- end -}}
{{- if and $site.credentials.secretName $site.nats.enabled -}}
{{- fail "siteState.credentials is for siteState.url: the chart's NATS server takes each router's certificate as its user" -}}
{{- end -}}
{{- $k := .Values.cloud.keda -}}
{{- if and $k.enabled (gt (int $k.minReplicaCount) (int $k.maxReplicaCount)) -}}
{{- fail (printf "cloud.keda.minReplicaCount (%d) is above maxReplicaCount (%d)" (int $k.minReplicaCount) (int $k.maxReplicaCount)) -}}
{{- end -}}
{{- $svc := .Values.router.service -}}
{{- if and (eq $svc.type "ClusterIP") (or $svc.nodePorts.grpc $svc.nodePorts.openai $svc.perPod.nodePorts) -}}
{{- fail "router.service.nodePorts and perPod.nodePorts need router.service.type NodePort or LoadBalancer" -}}
{{- end -}}
{{- if and $svc.perPod.enabled (eq $svc.type "ClusterIP") -}}
{{- fail "router.service.perPod is for agents outside the cluster: set router.service.type to NodePort or LoadBalancer" -}}
{{- end -}}
{{- if and $svc.perPod.nodePorts (ne (len $svc.perPod.nodePorts) (int (include "stratus.routerPods" .))) -}}
{{- fail (printf "router.service.perPod.nodePorts lists %d ports for %d router pods (router.replicas, or autoscaling.maxReplicas)" (len $svc.perPod.nodePorts) (int (include "stratus.routerPods" .))) -}}
{{- end -}}
{{- end -}}

{{/* The router Service's type, and what only a NodePort or LoadBalancer takes. */}}
{{- define "stratus.routerServiceType" -}}
{{- $svc := .Values.router.service -}}
type: {{ $svc.type }}
{{- if ne $svc.type "ClusterIP" }}
externalTrafficPolicy: {{ $svc.externalTrafficPolicy }}
{{- end }}
{{- if and (eq $svc.type "LoadBalancer") $svc.loadBalancerSourceRanges }}
loadBalancerSourceRanges:
  {{- toYaml $svc.loadBalancerSourceRanges | nindent 2 }}
{{- end }}
{{- end -}}
