{{/* Names and labels shared by every object. */}}
{{- define "kvroute.name" -}}{{ .Release.Name | trunc 55 | trimSuffix "-" }}{{- end -}}
{{- define "kvroute.pool" -}}{{ default (include "kvroute.name" .) .Values.inferencePool.name }}{{- end -}}
{{- define "kvroute.labels" -}}
app.kubernetes.io/name: kvroute
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .Values.mode }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: kvroute
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "kvroute.image" -}}{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}{{- end -}}
{{/* EPP mode with an InferencePool (created here or named): discovery follows the pool. */}}
{{- define "kvroute.usesPool" -}}
{{- if and (eq .Values.mode "epp") (or .Values.inferencePool.create .Values.inferencePool.name) }}true{{ end -}}
{{- end -}}
{{/* The engines' HTTP port: the pool's target port, or the first of discovery.targetPorts. */}}
{{- define "kvroute.enginePort" -}}
{{- if and (eq .Values.mode "epp") .Values.inferencePool.create }}{{ .Values.inferencePool.targetPort }}{{ else }}{{ first .Values.discovery.targetPorts }}{{ end -}}
{{- end -}}
{{/* The Envoy sidecar's failure mode follows the pool's: FailOpen needs a fallback cluster. */}}
{{- define "kvroute.envoyFailOpen" -}}
{{- if eq .Values.inferencePool.failureMode "FailOpen" }}true{{ end -}}
{{- end -}}
