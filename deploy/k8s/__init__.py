"""Kubernetes manifests for DFlash: deploy/k8s/render.py renders them from values files."""
