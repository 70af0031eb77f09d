{{/* The one namespace the components expect (api.names.SYSTEM_NAMESPACE). */}}
{{- define "sharegpu.namespace" -}}
{{- if ne .Release.Namespace "sharegpu-system" -}}
{{- fail (printf "install sharegpu into the namespace sharegpu-system (helm install -n sharegpu-system), not %q: the components look for their objects there" .Release.Namespace) -}}
{{- end -}}
sharegpu-system
{{- end -}}

{{- define "sharegpu.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "sharegpu.labels" -}}
app.kubernetes.io/part-of: sharegpu
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "sharegpu.selector" -}}
app.kubernetes.io/part-of: sharegpu
app.kubernetes.io/component: {{ . }}
{{- end -}}

{{/* The cluster's version as major.minor.patch (a provider's suffix dropped). */}}
{{- define "sharegpu.kubeVersion" -}}
{{- regexFind "^v?[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version | trimPrefix "v" -}}
{{- end -}}

{{- define "sharegpu.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "sharegpu.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/* Whether the webhook's certificates come from cert-manager. */}}
{{- define "sharegpu.certManager" -}}
{{- $source := .Values.webhook.certificates.source -}}
{{- if or (eq $source "cert-manager") (and (eq $source "auto") (.Capabilities.APIVersions.Has "cert-manager.io/v1")) -}}true{{- end -}}
{{- end -}}

{{/* prometheus.io annotations for a pod whose /metrics is on `port` (with metrics.podAnnotations). */}}
{{- define "sharegpu.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- if .https }}
prometheus.io/scheme: https
{{- end }}
{{- end -}}
{{- end -}}
