"""The generation core every API calls.

Admission, one request's event stream, fan-out over n requests, and the request-level metrics.
"""
