"""Deployment: compose, Kubernetes manifests and pods, the ingress, dashboards and alerts."""
