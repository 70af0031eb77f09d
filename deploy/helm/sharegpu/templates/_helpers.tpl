{{/* The one namespace the components expect (api.names.SYSTEM_NAMESPACE). */}}
{{- define "sharegpu.namespace" -}}
{{- if ne .Release.Namespace "sharegpu-system" -}}
{{- fail (printf "install sharegpu into the namespace sharegpu-system (helm install -n sharegpu-system), not %q: the components look for their objects there" .Release.Namespace) -}}
{{- end -}}
sharegpu-system
{{- end -}}

{{- /* The GPU-holding pods' namespace (reservations, groups' holders): api.names.HOLDING_NAMESPACE. */ -}}
{{- define "sharegpu.holdingNamespace" -}}
sharegpu-gpus
{{- end -}}

{{- /* The name in the health ports' certificate (templates/health-tls.yaml). */ -}}
{{- define "sharegpu.healthName" -}}
sharegpu-health.{{ include "sharegpu.namespace" . }}.svc
{{- end -}}

{{- /* A component's arguments, mount and volume for its health port's certificate. */ -}}
{{- define "sharegpu.healthTlsArgs" -}}
- --health-cert=/etc/sharegpu/health-tls/tls.crt
- --health-key=/etc/sharegpu/health-tls/tls.key
{{- end -}}
{{- define "sharegpu.healthTlsMount" -}}
- {name: health-tls, mountPath: /etc/sharegpu/health-tls, readOnly: true}
{{- end -}}
{{- define "sharegpu.healthTlsVolume" -}}
- name: health-tls
  secret:
    secretName: sharegpu-health-tls
    items: [{key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}]
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

{{/* prometheus.io annotations for a pod whose /metrics is on `port`, over HTTPS like every
     component's (with metrics.podAnnotations). */}}
{{- define "sharegpu.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
prometheus.io/scheme: https
{{- end -}}
{{- end -}}

{{- /* Whether the webhook's configurations carry CEL matchConditions (only pods that concern GPUs
     reach it): webhook.matchConditions, where `auto` means yes where a MutatingAdmissionPolicy hides
     the GPUs from the other pods (Kubernetes 1.36 and later, templates/nogpu.yaml), and no below,
     where then every pod reaches the webhook, which hides them. */ -}}
{{- define "sharegpu.matchConditions" -}}
{{- $set := .Values.webhook.matchConditions }}
{{- if eq (toString $set) "auto" }}
{{- include "sharegpu.mutatingPolicies" . }}
{{- else }}
{{- ternary "true" "false" (eq (toString $set) "true") }}
{{- end }}
{{- end }}

{{- /* Whether the cluster serves MutatingAdmissionPolicy in admissionregistration.k8s.io/v1 (GA in 1.36). */ -}}
{{- define "sharegpu.mutatingPolicies" -}}
{{- ternary "true" "false" (semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version) }}
{{- end }}

{{- /* A pod concerns GPUs when a container (of any kind) asks for a GPU resource, sets or loads GPU
     variables (but for NVIDIA_VISIBLE_DEVICES=void, which hides every GPU: the no-GPU policy sets it
     before the webhooks' conditions are evaluated), the pod has ephemeral containers (`kubectl
     debug`), the pod uses ResourceClaims (a claim of sharegpu's class is gated until sharegpu
     allocates it), or the pod carries sharegpu's (or a translated system's: KubeShare's kubeshare/*,
     KAI's gpu-fraction and gpu-memory) annotations.
     The webhook's matchConditions and, negated, the no-GPU MutatingAdmissionPolicy's: between them
     every pod. */ -}}
{{- define "sharegpu.concernsGpus" -}}
[object.spec.containers, has(object.spec.initContainers) ? object.spec.initContainers : []].exists(cs,
cs.exists(c, (has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, k.contains('gpu') || k.contains('vcuda') || k.startsWith('nvidia.com/mig-')))
|| (has(c.resources.requests) && c.resources.requests.exists(k, k.contains('gpu') || k.contains('vcuda') || k.startsWith('nvidia.com/mig-')))))
|| (has(c.env) && c.env.exists(e, (e.name.startsWith('NVIDIA_') && !(e.name == 'NVIDIA_VISIBLE_DEVICES' && has(e.value) && e.value == 'void')) || e.name.startsWith('CUDA_') || e.name.startsWith('SHAREGPU_') || e.name == 'LD_PRELOAD'))
|| has(c.envFrom)))
|| (has(object.spec.ephemeralContainers) && size(object.spec.ephemeralContainers) > 0)
|| (has(object.spec.resourceClaims) && size(object.spec.resourceClaims) > 0)
|| (has(object.metadata.annotations) && object.metadata.annotations.exists(k, k.startsWith('sharegpu.io/') || k.startsWith('deviceshare.io/') || k.startsWith('nvidia.com/') || k.startsWith('kubeshare/') || k.startsWith('gpu-')))
{{- end }}

{{- /* The namespaces sharegpu's admission reviews (a namespaceSelector): all but kube-system, its own,
     webhook.skipNamespaces and those labelled sharegpu.io/admission=skip. */ -}}
{{- define "sharegpu.reviewedNamespaces" -}}
{{- $skip := concat (list "kube-system" (include "sharegpu.namespace" .) (include "sharegpu.holdingNamespace" .)) .Values.webhook.skipNamespaces | uniq }}
{{- toYaml (dict "matchExpressions" (list (dict "key" "sharegpu.io/admission" "operator" "NotIn" "values" (list "skip")) (dict "key" "kubernetes.io/metadata.name" "operator" "NotIn" "values" $skip))) }}
{{- end }}

{{- /* A Secret's data for a PKI the chart makes (helm mode): a CA and a serving pair (and, with
     `client`, a client pair), valid `days` (365), made once and kept across upgrades (read back with
     `lookup`), and made again by the first upgrade within `renew` days (90) of the expiry the Secret's
     annotation sharegpu.io/not-after records (a Secret without it, as older charts made, is renewed at
     once). A renewed ca.crt holds the new CA and the old one, so that what still runs with the old
     pair is trusted until its pods restart (the pod templates carry the data's digest: they roll).
     Arguments: dict "root" . "secret" <lookup> "ca" <CA name> "cn" <common name> "ips" <list>
     "dns" <list> "client" <common name or "">. Output: YAML {annotations: ..., data: ...}. */ -}}
{{- define "sharegpu.pki" -}}
{{- $days := 365 }}
{{- $renew := 90 }}
{{- $now := int (unixEpoch now) }}
{{- $keep := false }}
{{- $old := "" }}
{{- with .secret }}
{{- if .data }}
{{- $notAfter := int ((.metadata.annotations | default dict) | dig "sharegpu.io/not-after" "0") }}
{{- $keep = gt (sub $notAfter $now) (mul $renew 86400) }}
{{- $old = index .data "ca.crt" | default "" }}
{{- end }}
{{- end }}
{{- if $keep }}
{{- toYaml (dict "annotations" .secret.metadata.annotations "data" .secret.data) }}
{{- else }}
{{- $ca := genCAWithKey .ca $days (genPrivateKey "ecdsa") }}
{{- $pair := genSignedCertWithKey .cn .ips .dns $days $ca (genPrivateKey "ecdsa") }}
{{- $bundle := $ca.Cert }}
{{- if $old }}
{{- $previous := b64dec $old | splitList "-----END CERTIFICATE-----" | first }}
{{- $bundle = printf "%s%s-----END CERTIFICATE-----\n" $ca.Cert $previous }}
{{- end }}
{{- $data := dict "ca.crt" ($bundle | b64enc) "tls.crt" ($pair.Cert | b64enc) "tls.key" ($pair.Key | b64enc) }}
{{- if .client }}
{{- $client := genSignedCertWithKey .client nil nil $days $ca (genPrivateKey "ecdsa") }}
{{- $_ := set $data "client.crt" ($client.Cert | b64enc) }}
{{- $_ := set $data "client.key" ($client.Key | b64enc) }}
{{- end }}
{{- toYaml (dict "annotations" (dict "sharegpu.io/not-after" (toString (add $now (mul $days 86400)))) "data" $data) }}
{{- end }}
{{- end }}
