{{/* Names and labels shared by every object. */}}
{{- define "kvroute.name" -}}{{ .Release.Name | trunc 55 | trimSuffix "-" }}{{- end -}}
{{- define "kvroute.pool" -}}{{ default (include "kvroute.name" .) .Values.inferencePool.name }}{{- end -}}
{{- define "kvroute.labels" -}}
app.kubernetes.io/name: kvroute
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .Values.mode }}
{{- end -}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: kvroute
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
