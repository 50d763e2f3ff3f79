"""Prometheus metrics under TGI's names, and OpenTelemetry spans of each request."""
